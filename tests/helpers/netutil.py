"""Helpers for tests that start real servers and process groups. Their home is
benchmarks/local_ranks.py (the CPU benchmarks use them too); this name stays for tests."""
from benchmarks.local_ranks import free_port, gloo_dims, run_ranks

__all__ = ["free_port", "gloo_dims", "run_ranks"]
