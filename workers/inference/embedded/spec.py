"""Registers the embedded backend: one CPU process per worker, no router, no plan steps.

Torch-free at import (the launcher reads the spec); the engine and server are imported when
a server task starts (:func:`serve`).
"""
from __future__ import annotations

from workers.inference.embedded.config import EmbeddedInferenceConfig
from workers.inference.spec import BackendConfigError, BackendSpec, register


def check(cfg) -> None:
    """Plan-time: the admission queue and the connection timeout must be positive."""
    inf = cfg.inference
    if not (isinstance(inf.max_queued_requests, int) and inf.max_queued_requests >= 1):
        raise BackendConfigError(f"inference.max_queued_requests must be an integer >= 1, got {inf.max_queued_requests!r}")
    if not 0 < float(inf.idle_timeout_s) < float("inf"):
        raise BackendConfigError(f"inference.idle_timeout_s must be a finite number > 0, got {inf.idle_timeout_s!r}")


def serve(cfg, topology) -> int:
    """The server task: load the newest stable weights, serve SGLang's HTTP API until SIGTERM."""
    import torch

    from workers.inference.embedded.server import run_server

    torch.set_num_threads(cfg.inference.num_threads)
    return run_server(cfg, topology)


SPEC = register(BackendSpec(
    name="embedded", config=EmbeddedInferenceConfig, serve=serve, check=check,
    summary="the tiny-model engine of this repo behind SGLang's HTTP API (CPU or one GPU per worker)"))
