"""Test-only plugin entries (one per axis), registered from the test tree: import one, or name it
in ``SLURMRL_PLUGINS`` (e.g. ``SLURMRL_PLUGINS=tests.plugins.weights_plugin``)."""
