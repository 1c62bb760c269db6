"""The plan refuses SGLang option combinations that SGLang rejects or silently rewrites
(workers/inference/sglang/checks.py), naming the key and saying why; every SGLang preset plans."""
from __future__ import annotations

import pytest

from launcher.plan import PlanError, build_plan
from tests.unit.inference.sglang_cases import PRESETS
from tests.conftest import compose

GLM5 = PRESETS["glm5_swe_28xh200"]
KIMI = PRESETS["kimi_k2_swe_32xh200"]
UNIFIED = PRESETS["inference_sglang"]
D = "inference.decode.sglang"
P = "inference.prefill.sglang"
W = "inference.worker.sglang"

CASES = [
    # (overrides on top of a preset, a fragment the message must contain)
    (KIMI + ["weights=broadcast", "weights.verify_fraction=0.1"],
     "SGLang 0.5.23's DeepseekV3ForCausalLM has no get_weights_by_name"),
    (GLM5 + ["inference.decode.ep=16"], "inference.decode.ep(16) must equal inference.decode.tp(32) with "
                                        "inference.decode.sglang.moe_a2a_backend=deepep"),
    (GLM5 + [f"{D}.deepep_mode=normal"], "SGLang then disables CUDA graphs"),
    (KIMI + [f"{W}.deepep_mode=normal"], "deepep_mode=normal on a server that decodes (inference)"),
    (GLM5 + [f"{D}.moe_a2a_backend=none"], "deepep_mode='low_latency' needs inference.decode.sglang.moe_a2a_backend=deepep"),
    (GLM5 + [f"{D}.moe_a2a_backend=pplx"], "moe_a2a_backend='pplx' is not supported"),
    (UNIFIED + ["inference.worker.ep=1", f"{W}.moe_a2a_backend=none", f"{W}.deepep_mode=auto",
                f"{W}.enable_eplb=true"], "need inference.worker.ep > 1"),
    (UNIFIED + ["inference.worker.dp_attention=1", f"{W}.enable_dp_lm_head=true"],
     "enable_dp_lm_head needs inference.worker.dp_attention > 1"),
    (UNIFIED + ["inference.worker.num_replicas_per_node=2", "inference.worker.tp=4", "inference.worker.ep=4",
                "inference.worker.dp_attention=2"], "derives 6 ZMQ ports above each replica's"),
    (GLM5 + [f"{P}.hicache_size_gb=64"], "set hicache_ratio(2.0) or hicache_size_gb(64), not both"),
    (GLM5 + [f"{P}.hicache_storage_dir=null"], "hicache_storage_backend=file needs"),
    (GLM5 + [f"{P}.enable_hierarchical_cache=false"], "set but inference.prefill.sglang.enable_hierarchical_cache is false"),
    (GLM5 + [f"{P}.hicache_write_policy=write_sometimes"], "hicache_write_policy='write_sometimes' is not supported"),
    (GLM5 + [f"{P}.decode_radix_cache=true"], "decode_radix_cache applies to decode servers"),
    (GLM5 + [f"{D}.decode_radix_cache=true", "inference.sglang.disaggregation_transfer_backend=fake"],
     "incompatible with inference.sglang.disaggregation_transfer_backend=fake"),
    (GLM5 + ["inference.sglang.disaggregation_transfer_backend=rdma"], "disaggregation_transfer_backend='rdma'"),
    (GLM5 + ["inference.sglang.model_path="], "inference.sglang.model_path is empty"),
    (GLM5 + ["inference.sglang.mem_fraction_static=1.2"], "mem_fraction_static must be in (0, 1)"),
    (GLM5 + ["inference.sglang.kv_cache_dtype=int4"], "kv_cache_dtype='int4' is not supported"),
    (GLM5 + ["inference.sglang.router.prefill_policy=sticky"], "router.prefill_policy='sticky' is not supported"),
    (GLM5 + ["inference.sglang.router.routing_key_header="], "routing_key_header is empty"),
    (GLM5 + ["cluster.port_span=24"], "cluster.port_span(24) < 32 ports this SGLang job needs"),
    (GLM5 + [f"{D}.cuda_graph_max_bs=0"], "inference.decode.sglang.cuda_graph_max_bs must be > 0"),
    (GLM5 + ["inference.dtype=float32"], "weights.delta=true into SGLang: patches carry the trainer's bfloat16"),
    (GLM5 + ["weights.delta_fraction_assumed=1.5"], "weights.delta_fraction_assumed"),
]


@pytest.mark.parametrize("overrides,fragment", CASES, ids=[c[1][:48] for c in CASES])
def test_conflicts_are_refused_with_the_reason(overrides, fragment):
    with pytest.raises(PlanError) as e:
        build_plan(compose(overrides))
    assert fragment in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_sglang_preset_plans(name):
    p = build_plan(compose(PRESETS[name]))
    assert p.backend_steps and p.backend_steps[-1].role == "router"
    assert {s.role for s in p.backend_steps[:-1]} == {r.role for r in p.roles if r.server is not None}


def test_deepep_normal_is_fine_on_prefill_and_with_cuda_graphs_off_on_decode():
    build_plan(compose(GLM5))  # prefill: normal
    build_plan(compose(GLM5 + [f"{D}.deepep_mode=normal", f"{D}.disable_cuda_graph=true"]))


def test_the_orchestrator_side_of_the_sglang_spec():
    """Generation goes through smg keyed per prompt group; the routing shape comes from cfg.model."""
    import asyncio

    import aiohttp

    from workers.common.registry import BACKENDS

    spec, cfg = BACKENDS.get("sglang"), compose(GLM5)
    assert spec.needs_router and spec.uses_gpus and spec.supports_disaggregation and not spec.reports_routing_shape

    async def make():
        async with aiohttp.ClientSession() as session:
            return spec.make_router(cfg, "http://router:1", "tok", session=session, timeout_s=5, shape=(1, 2, 3))
    router = asyncio.run(make())
    client = router.for_group(7)
    assert client.routing_key == f"{cfg.experiment}-g7" and router.header == cfg.inference.sglang.router.routing_key_header
    assert BACKENDS.get("embedded").make_router is None and BACKENDS.get("embedded").reports_routing_shape


def test_broadcast_into_sglang_and_router_replay_with_pd_plan():
    """SGLang servers take the broadcast (their own protocol) and R3 runs through PD; the plan says
    what one update moves per inference GPU and how long it takes at the cluster's NIC rate."""
    from workers.weights.sglang.wire import BULK_EFFICIENCY

    cfg = compose(GLM5 + ["weights=broadcast", "weights.delta=false", "trainer.router_replay=true", "orchestrator.return_routed_experts=true"])
    p = build_plan(cfg)
    line = next(x for x in p.summary() if x.startswith("weights: broadcast into SGLang"))
    gb = p.params.total * 2 / 1e9
    assert f"{gb:.1f} GB per inference GPU per update" in line
    assert f"~{gb / (cfg.cluster.nic_gb_s * BULK_EFFICIENCY):.1f} s at cluster.nic_gb_s=" in line


def test_pd_with_routed_experts_pairs_servers_in_the_orchestrator():
    import asyncio
    import types

    import aiohttp

    from workers.common.registry import BACKENDS
    from workers.inference.sglang.pd_client import PDPairs

    cfg = compose(GLM5 + ["orchestrator.return_routed_experts=true"])
    urls = tuple(f"http://n{i}:{30000 + i}" for i in range(4))
    topo = types.SimpleNamespace(prefill_urls=urls[:2], decode_urls=urls[2:], inference_urls=urls)

    async def make():
        async with aiohttp.ClientSession() as session:
            return BACKENDS.get("sglang").make_router(cfg, "http://router:1", "tok", session=session, timeout_s=5,
                                                      shape=(1, 2, 3), topology=topo)
    pairs = asyncio.run(make())
    assert isinstance(pairs, PDPairs) and pairs.health.base_url == "http://router:1"
    c = pairs.for_group(3)
    assert c.prefill.base_url in urls[:2] and c.decode.base_url in urls[2:] and c.routing_key == f"{cfg.experiment}-g3"
    assert c.bootstrap["bootstrap_port"] == pairs.ports[urls.index(c.prefill.base_url)]
