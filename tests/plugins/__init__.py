"""Test-only plugin entries (one per axis), registered from the test tree by importing them
(SLURMRL_PLUGINS=tests.plugins.<axis>_plugin); no project file names them."""
