"""The simulator's cost model, workload and layouts (tools/simulator/costs.py, workload.py, layout.py).

What is pinned: the efficiencies derived from the published anchors reproduce those
anchors exactly; merging turns into segments changes no total; every node split the
search proposes is one the launcher's build_plan accepts; a GLM-5 step simulates end to end.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tools.simulator import study
from tools.simulator.assumptions import ANCHOR_DECODE_EXPERTS_PER_GPU, ANCHOR_DECODE_NODES, DEEPSEEK_V3, Assumptions, table
from tools.simulator.calibrate import _lsq
from tools.simulator.costs import ClusterCosts, ModelFacts, Replica, decode_step, derive_efficiencies
from tools.simulator.engine import Sim
from tools.simulator.layout import candidate_splits, fit_memory, layout_from_plan, with_split
from tools.simulator.system import System
from tools.simulator.workload import SweWorkload, draws, heavy_tail
from tools.simulator.cli import compose
from workers.models.facts import Architecture
from launcher.plan import build_plan


@pytest.fixture(scope="module")
def glm5():
    return compose(["experiment=glm5_swe_28xh200", "orchestrator.num_prompts_per_step=32"])


def test_anchors_are_reproduced():
    """Prefill: 52.3k tok/s/node back out of the derived efficiency; decode: the 92 ms ITL at
    256 sequences/GPU on EP72 comes back out of decode_step with the derived efficiency."""
    a = Assumptions()
    eff_p, eff_d = derive_efficiencies(a)
    v3 = ModelFacts(Architecture(**DEEPSEEK_V3), a.with_changes({"serving.dsa_topk": 10**9}))
    ctx = a.serving.anchor_decode_ctx
    tok_s_node = 8 * a.hw.fp8_tflops * 1e12 * eff_p / (v3.prefill_flops(ctx, 0) / ctx)
    assert tok_s_node == pytest.approx(a.serving.anchor_prefill_tok_s_node)
    gpus = ANCHOR_DECODE_NODES * 8
    itl = decode_step(v3, a, n=256 * gpus, ctx=ctx, gpus=gpus, nodes=ANCHOR_DECODE_NODES, tp=gpus, ep=gpus, dp=gpus,
                      dtype_bytes=1, kv_bytes=2, peak=a.hw.fp8_tflops * 1e12, hbm=3.35e12,
                      a2a=a.hw.nic_gb_s * 1e9 * a.hw.a2a_efficiency / (1 - 1 / ANCHOR_DECODE_NODES), eff=eff_d,
                      experts_per_gpu=ANCHOR_DECODE_EXPERTS_PER_GPU, dispatch_bytes=1)
    assert itl == pytest.approx(a.serving.anchor_decode_itl_s, rel=1e-6)
    assert 0.05 < eff_d < 0.6 and 0.05 < eff_p < 0.6


def test_glm5_facts_match_the_plan(glm5):
    """Active params and KV bytes agree with launcher/estimate.py (the plan's own counts)."""
    f = ModelFacts(glm5.model, Assumptions())
    assert f.active == pytest.approx(41.8e9, rel=0.01)
    assert f.routed + f.replicated == f.total
    # MLA latent 512 + rope 64 in bf16 over 78 layers, plus the 128-byte FP8 indexer key
    assert f.kv_bytes_per_token(2) == 78 * (576 * 2 + 128)
    # DSA: past 2048 keys, attention grows only through the FP8 indexer (half-cost FLOPs)
    assert f.prefill_flops(1, 100_000) - f.prefill_flops(1, 50_000) == pytest.approx(2 * 78 * 32 * 128 * 50_000 * 0.5)


def test_decode_step_grows_with_batch_and_fp8_is_faster(glm5):
    a = Assumptions()
    r = Replica(kind="decode", index=0, num_gpus=32, num_nodes=4, tp=32, ep=32, dp_attention=32)
    bf16 = ClusterCosts(glm5.model, a, infer_dtype="bfloat16", trainer_gpus=128, trainer_nodes=16, max_batch_size=256)
    fp8 = ClusterCosts(glm5.model, a.with_changes({"serving.fp8_inference": True}), infer_dtype="bfloat16",
                       trainer_gpus=128, trainer_nodes=16, max_batch_size=256)
    small, big = bf16.decode_step_s(r, 32, 32 * 50_000), bf16.decode_step_s(r, 4096, 4096 * 50_000)
    assert small < big and 4096 / big > 32 / small  # throughput rises with batch, latency too
    assert fp8.decode_step_s(r, 32, 32 * 50_000) < small


def test_weight_update_is_the_plans_figure():
    """Dense broadcast into SGLang: the simulator's wire time is the one the plan prints (sglang/wire.update_cost)."""
    from workers.weights.sglang.wire import BULK_EFFICIENCY, update_cost

    glm5 = compose(["experiment=glm5_swe_28xh200", "weights.delta=false"])
    a = Assumptions()
    assert a.hw.bulk_efficiency == BULK_EFFICIENCY
    c = ClusterCosts(glm5.model, a, infer_dtype="bfloat16", trainer_gpus=128, trainer_nodes=16, max_batch_size=256)
    r = Replica(kind="decode", index=0, num_gpus=32, num_nodes=4, tp=32, ep=32, dp_attention=32)
    wire, paused = c.weight_sync([r], "broadcast")
    plan = build_plan(glm5)
    assert wire == update_cost(plan.params.total * 2, a.hw.nic_gb_s, a.hw.bulk_efficiency)[1]
    assert a.hw.nic_gb_s == glm5.cluster.nic_gb_s and f"~{wire:.1f} s at cluster.nic_gb_s=" in plan.weight_update
    assert paused == pytest.approx(wire + a.weights.update_overhead_s)


@pytest.mark.parametrize("preset", ["glm5_swe_28xh200", "kimi_k2_swe_32xh200"])
def test_sparse_updates_are_the_plans_figure_and_within_two_seconds(preset):
    """weights.delta: the presets' plans print <= 2.0 s per update at nic_gb_s=50 with the assumed fraction,
    and the simulator's wire time (same replicas, same senders) is that figure (sglang/patch_cost.delta_update_cost)."""
    cfg = compose([f"experiment={preset}", "cluster.nic_gb_s=50"])
    assert cfg.weights.delta and cfg.weights.transport == "broadcast"
    plan = build_plan(cfg)
    layout = layout_from_plan(plan)
    c = study.costs_for(cfg, layout, Assumptions())
    loop = study.loop_config(cfg, steps=1, warmup=0, seed=0, transport="broadcast")
    assert loop.delta_fraction == cfg.weights.delta_fraction_assumed
    wire, _ = c.weight_sync(layout.replicas, "broadcast", delta_fraction=loop.delta_fraction)
    dense, _ = c.weight_sync(layout.replicas, "broadcast")
    assert wire <= 2.0 < dense
    line = plan.weight_update
    assert f"~{wire:.2f} s at cluster.nic_gb_s=50" in line, line
    assert f"delta_fraction_assumed={cfg.weights.delta_fraction_assumed:g}" in line and "per-rank delivery" in line


def test_turn_merging_keeps_every_total():
    """Same draws, 1000 vs 8 segments: tokens, generated tokens and env seconds are identical."""
    facts = Assumptions().swe
    fine, coarse = SweWorkload(facts, max_segments=1000), SweWorkload(facts, max_segments=8)
    for seed in range(20):
        a, b = fine.group(random.Random(seed), 4), coarse.group(random.Random(seed), 4)
        for x, y in zip(a, b):
            assert len(y.segments) <= 8
            assert (x.total_tokens, x.completion_tokens) == (y.total_tokens, y.completion_tokens)
            assert sum(s.env_s for s in x.segments) == pytest.approx(sum(s.env_s for s in y.segments))
            assert sum(s.prefill_tokens for s in x.segments) == sum(s.prefill_tokens for s in y.segments)
            assert x.total_tokens <= facts.max_context


@pytest.mark.parametrize("regime,changes", [("roomy cache", {"serving.host_cache_gb_per_node": 1000.0}),
                                            ("thrashing cache", {"serving.mem_fraction": 0.75})])
def test_turn_merging_matches_per_turn_away_from_the_cache_edge(glm5, regime, changes):
    """8 merged segments vs one per turn, 128 rollouts/step on P1x2 D5x2 T16: within 20% when the
    prefill prefix cache holds the working set and when it thrashes (near the edge the two differ,
    which is why study.segments_for simulates per turn there)."""
    cfg = dataclasses.replace(glm5, orchestrator=dataclasses.replace(glm5.orchestrator, num_prompts_per_step=16))
    variant = with_split(cfg, prefill=(1, 2), decode=(5, 2), trainer_nodes=16)
    layout = layout_from_plan(build_plan(variant))
    a = Assumptions().with_changes(changes)
    costs = study.costs_for(variant, layout, a)
    layout = fit_memory(layout, costs, 141)
    loop = study.loop_config(variant, steps=6, warmup=2, seed=0, transport="broadcast")
    steps = []
    for segments in (8, 1000):
        system = System(Sim(), costs, layout, SweWorkload(a.swe, max_segments=segments), loop)
        system.run()
        steps.append(system.summary()["step_s"])
    assert steps[0] == pytest.approx(steps[1], rel=0.2)


@pytest.mark.parametrize("law", ["lognormal", "pareto"])
def test_heavy_tails_have_the_requested_median_and_p99(law):
    rng = random.Random(3)
    xs = sorted(heavy_tail(rng, law, 2.0, 20.0) for _ in range(40_000))
    ys = sorted(draws(np.random.default_rng(3), law, 2.0, 20.0, 40_000))
    for v in (xs, ys):
        assert v[len(v) // 2] == pytest.approx(2.0, rel=0.05)
        assert v[int(0.99 * len(v))] == pytest.approx(40.0, rel=0.15)


def test_every_split_is_a_valid_plan(glm5):
    seen = 0
    for variant, plan in candidate_splits(glm5, 28, replica_nodes=(2, 4)):
        seen += 1
        assert plan.num_gpu_nodes == 28
        assert variant.launcher.trainer.num_nodes >= 16  # 16 B/param of 754B params need >= 86 H200s
        build_plan(variant)
    assert seen >= 4


def test_memory_fit_lowers_dp_attention(glm5):
    """2-node bf16 prefill with attention replicated on 16 DP ranks leaves no KV room: 4 fits."""
    layout = layout_from_plan(build_plan(glm5))
    costs = study.costs_for(glm5, layout, Assumptions())
    fixed = fit_memory(layout, costs, 141)
    assert [r.dp_attention for r in fixed.of("prefill")] == [4, 4]
    assert [r.dp_attention for r in fixed.of("decode")] == [32, 32]
    assert fixed.notes


def test_glm5_step_simulates_end_to_end(glm5):
    layout = layout_from_plan(build_plan(glm5))
    loop = study.loop_config(glm5, steps=4, warmup=2, seed=0, transport="broadcast")
    s = study.simulate(glm5, layout, Assumptions(), loop).summary
    assert s["step_s"] > 0 and 0 <= s["trainer_idle_frac"] <= 1
    assert set(s["roles"]) == {"prefill", "decode", "trainer"}
    assert s["bottleneck"]


def test_assumption_table_has_a_source_for_every_number():
    rows = table(Assumptions())
    assert len(rows) > 30
    assert all(src for _, _, _, src in rows)


def test_lsq_recovers_a_line():
    assert _lsq([[1.0, x] for x in (1, 2, 3)], [2 + 3 * x for x in (1, 2, 3)]) == pytest.approx([2, 3])


def test_fast_decode_step_matches_the_reference(glm5):
    """ClusterCosts.decode_step_fn (the simulator's hot path) equals decode_step, bf16 and FP8."""
    for fp8 in (False, True):
        a = Assumptions().with_changes({"serving.fp8_inference": fp8})
        costs = ClusterCosts(glm5.model, a, infer_dtype="bfloat16", trainer_gpus=128, trainer_nodes=16, max_batch_size=256)
        for r in (Replica(kind="decode", index=0, num_gpus=32, num_nodes=4, tp=32, ep=32, dp_attention=32),
                  Replica(kind="decode", index=0, num_gpus=16, num_nodes=2, tp=16, ep=16, dp_attention=4,
                          redundant_experts=32)):
            fast = costs.decode_step_fn(r)
            for n, ctx in ((1, 1_000), (64, 3e6), (2000, 1e8)):
                assert fast(n, ctx) == pytest.approx(costs.decode_step_s(r, n, ctx), rel=1e-12)


def test_filesystem_pull_is_the_plans_per_rank_figure():
    """weights.transport=filesystem with sparse patches into SGLang: every rank pulls its share; the
    simulator's pause is the plan's figure (sglang/pull_cost: the slower of the largest rank's NIC and the
    shared filesystem's aggregate), and with GLM-5's 96 server ranks on a 100 GB/s scratch filesystem
    the storage decides and the whole-patch broadcast is faster: the simulator must show that."""
    cfg = compose(["experiment=glm5_swe_28xh200", "cluster.nic_gb_s=50", "weights=filesystem", "weights.delta=true",
                   "weights.delta_fraction_assumed=0.011"])
    plan = build_plan(cfg)
    layout = layout_from_plan(plan)
    a = Assumptions()
    assert a.weights.fs_gb_s == cfg.cluster.shared_fs_gb_s
    c = study.costs_for(cfg, layout, a)
    loop = study.loop_config(cfg, steps=1, warmup=0, seed=0, transport="filesystem")
    assert loop.delta_fraction == 0.011
    write, paused = c.weight_sync(layout.replicas, "filesystem", delta_fraction=loop.delta_fraction)
    pull = paused - a.weights.update_overhead_s
    assert f"~{pull:.2f} s per update" in plan.weight_update, plan.weight_update
    whole, _ = c.weight_sync(layout.replicas, "broadcast", delta_fraction=loop.delta_fraction)
    dense_write, dense_paused = c.weight_sync(layout.replicas, "filesystem")
    assert whole < pull < dense_paused and write < dense_write
