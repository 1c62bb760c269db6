"""Registers the SGLang backend: GPU servers, prefill/decode disaggregation, smg as the router.

Torch- and sglang-free at import: the launcher reads ``check`` and ``plan_steps`` on the login
node. Server and router tasks exec into SGLang / smg (server.py, router.py); the orchestrator
gets its router client through ``make_router`` (router_client.py).
"""
from __future__ import annotations

from workers.common.protocol import RunPaths
from workers.inference.sglang.checks import check_sglang, sglang_steps
from workers.inference.sglang.config import SGLangInferenceConfig
from workers.inference.spec import BackendSpec, register


def serve(cfg, topology) -> int:
    """Become this task's SGLang server (exec: never returns)."""
    from workers.inference.sglang.server import exec_server

    exec_server(cfg, topology, key_file=str(RunPaths(topology.run_dir).admin_token))  # never on argv (keyed.py)
    return 1  # not reached: exec_server replaces the process


def serve_router(cfg, topology) -> int:
    """Become smg in front of the job's servers (exec: never returns)."""
    from workers.inference.sglang.router import exec_router

    exec_router(cfg, topology, key_file=str(RunPaths(topology.run_dir).admin_token))
    return 1  # not reached


def make_router(cfg, url: str, admin_token: str, *, session, timeout_s: float, shape, topology=None):
    """Generation through smg, keyed per prompt group (router_client.py); with prefill/decode
    disaggregation and routed experts, through prefill/decode pairs the orchestrator picks itself
    and whose routing it merges (pd_client.py: smg does not merge the prefill server's routing)."""
    from workers.inference.sglang.router_client import Router

    router = Router(url, admin_token, header=cfg.inference.sglang.router.routing_key_header, prefix=cfg.experiment,
                    session=session, timeout_s=timeout_s, shape=shape)
    if topology is not None and topology.prefill_urls and cfg.orchestrator.return_routed_experts:
        from workers.inference.sglang.pd_client import PDPairs

        return PDPairs(cfg, topology, admin_token, session=session, timeout_s=timeout_s, shape=shape,
                       health=router.health)
    return router


SPEC = register(BackendSpec(
    name="sglang", config=SGLangInferenceConfig, check=check_sglang, serve=serve, uses_gpus=True,
    supports_disaggregation=True, needs_router=True, router_description="router: sglang-router in front of the servers",
    serve_router=serve_router, plan_steps=sglang_steps, reports_routing_shape=False, make_router=make_router,
    summary="SGLang servers on GPU nodes behind smg (prefill/decode disaggregation, DeepEP, HiCache)"))
