"""Hydra config tree of slurmrl (a package so Hydra finds it from the installed console script)."""
