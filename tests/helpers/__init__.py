"""Test helpers by topic; the conftest files re-export them for the tests that import them from there."""
