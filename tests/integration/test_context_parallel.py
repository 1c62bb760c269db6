"""Context parallelism (trainer.parallel.cp) equals one rank: model forward/backward and the trainer step.

Model level, every attention kind: each family's tiny model (seeded, float32) runs on real gloo
processes, each rank on its contiguous chunk of two rows (one right-padded) with Ulysses
all-to-alls inside attention / Mamba-2 (workers/models/blocks/ulysses.py); a next-token
log-likelihood weighted per position is summed on each rank's positions and backpropagated, the
gradients summed over ranks. Rank 0 compares the gathered logits, the gathered routing records
(Router Replay forcing half the positions: forced experts exactly, the rest routed identically)
and the summed gradients with a one-process forward/backward of the whole rows. cp 2 and cp 4
cover GQA with kv heads split and repeated (qwen3_moe kv 2), MLA (deepseek_v3), MLA + the DSA
indexer with a real top-k (glm_moe_dsa, index_topk 8 < 16 tokens) and Mamba-2 with its groups
split and repeated plus NoPE GQA (nemotron_h).

Trainer step: the real ``backward_step`` under the FSDP plan on a dp x cp mesh, one AdamW step,
against the one-process reference of tests/integration/test_parity_fsdp.py (same loss, grad norm,
clipped gradients and updated weights), with micro-batches, activation checkpointing and packing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.conftest import compose
from tests.integration import test_parity_parallel as moe
from tests.integration import test_parity_trainer_loop as loop
from tests.integration.step_parity import assert_step_matches, step_and_save
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.common.registry import MODELS
from workers.models.blocks import kernels
from workers.models.blocks.ulysses import SeqShard
from workers.trainer.parallel.fsdp import parallelize
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.precision import Precision

T = 16
SMALL = {"tiny_moe": ["model.hidden_size=32", "model.num_layers=2", "model.expert_intermediate_size=32"]}


def tiny(family: str, *overrides: str):
    preset = {"tiny_moe": "tiny_moe"}.get(family, f"{family}_tiny")
    return compose([f"model={preset}", *SMALL.get(family, []), *overrides]).model


def inputs(mcfg) -> dict:
    g = torch.Generator().manual_seed(5)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 11:] = False  # right padding, as the trainer's rows
    ids = torch.randint(0, mcfg.vocab_size, (2, T), generator=g) * valid
    weights = torch.randn(2, T, generator=g) * valid
    layers, k = mcfg.num_routed_layers, mcfg.top_k
    forced = (torch.stack([torch.randperm(mcfg.num_experts, generator=g)[:k] for _ in range(2 * T * layers)])
              .view(2, T, layers, k) if layers else None)  # a dense model: nothing to replay
    forced_mask = ((torch.rand(2, T, generator=g) < 0.5) & valid) if layers else None
    return {"ids": ids, "valid": valid, "weights": weights, "forced": forced, "forced_mask": forced_mask}


def weighted_nll(logits: torch.Tensor, next_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, next_ids[..., None])[..., 0]
    return (logp * weights).sum()


def model_reference(mcfg, x: dict) -> dict:
    model = MODELS.get(mcfg.family).init(mcfg, torch.float32)
    out = model(x["ids"], attention_mask=x["valid"], forced_experts=x["forced"], forced_mask=x["forced_mask"])
    next_ids = torch.cat([x["ids"][:, 1:], torch.zeros_like(x["ids"][:, :1])], dim=1)
    weighted_nll(out.logits, next_ids, x["weights"]).backward()
    return {"logits": out.logits.detach(), "routed": out.routed_experts,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _model_worker(rank: int, world: int, port: int, mcfg, x: dict, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, cp=world)
    try:
        model = MODELS.get(mcfg.family).init(mcfg, torch.float32)
        cp = SeqShard(group=dims.get_group("cp"), size=world, rank=dims.cp_rank, valid=x["valid"])
        t = T // world
        positions = torch.arange(rank * t, (rank + 1) * t).expand(2, t)
        local = {k: None if x[k] is None else cp.local(x[k]) for k in ("forced", "forced_mask")}
        res = model(cp.local(x["ids"]), position_ids=positions, attention_mask=cp.local(x["valid"]),
                    forced_experts=local["forced"], forced_mask=local["forced_mask"], cp=cp)
        next_ids = torch.cat([x["ids"][:, 1:], torch.zeros_like(x["ids"][:, :1])], dim=1)
        weighted_nll(res.logits, cp.local(next_ids), cp.local(x["weights"])).backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n] = g
        logits = gather(res.logits.detach(), world)
        routed = gather(res.routed_experts, world)
        if rank == 0:
            torch.save({"logits": logits, "routed": routed, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def gather(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


FAMILIES = ["tiny_moe", "qwen3_moe", "deepseek_v3", "glm_moe_dsa", "nemotron_h", "gemma3_text", "gpt_oss"]
CASES = [(f, cp) for f in FAMILIES for cp in (2, 4)]


@pytest.mark.parametrize("family,cp", CASES, ids=[f"{f}-cp{c}" for f, c in CASES])
def test_context_parallel_forward_and_backward_equal_one_rank(tmp_path, family, cp):
    check_family(tmp_path, family, cp)


FEW_HEADS = {"tiny_moe": ["model.num_heads=2"], "deepseek_v3": ["model.num_heads=2"],
             "glm_moe_dsa": ["model.num_heads=2"], "nemotron_h": ["model.num_heads=2", "model.num_kv_heads=1"]}


@pytest.mark.parametrize("family", sorted(FEW_HEADS))
def test_attention_with_fewer_heads_than_cp_gathers_keys_and_values(tmp_path, family):
    """2 attention heads over cp 4 (GQA with one kv head, MLA, MLA + DSA; nemotron_h's Mamba-2 still
    splits its 4 heads): keys/values all-gathered, each rank's own queries; the same numbers."""
    check_family(tmp_path, family, 4, FEW_HEADS[family])


@pytest.mark.parametrize("overrides", [["model.dsa_chunk_tokens=3"], ["model.dsa_chunk_tokens=3", "model.num_heads=2"],
                                       ["model.dsa_chunk_tokens=0"]], ids=["chunk3", "chunk3-gathered", "dense"])
def test_dsa_sparse_chunks_and_dense_reference_under_cp(tmp_path, overrides):
    """GLM-5's memory-linear path with query chunks smaller than a rank's rows (each rank chooses for its
    queries, every rank attends over the gathered choice, after the all-to-all or with gathered keys), and
    the dense reference path, each against one rank of the same model."""
    check_family(tmp_path, "glm_moe_dsa", 2 if "model.num_heads=2" not in overrides else 4, overrides)


@pytest.mark.parametrize("overrides", [[], ["model.num_heads=2", "model.num_kv_heads=1"]], ids=["ulysses", "gathered"])
def test_a_sliding_window_shorter_than_the_rows_under_cp(tmp_path, overrides):
    """mistral_tiny's window (8 keys) over 16-token rows at cp 2: the banded whole-sequence mask after the
    all-to-all (Ulysses), and each rank's banded rows with gathered keys (2 heads: too few to split)."""
    check_family(tmp_path, "mistral", 2 if not overrides else 4, overrides)


@pytest.mark.parametrize("family,cp", [("qwen3_moe", 4), ("nemotron_h", 2), ("mistral", 2)])
def test_the_causal_fast_path_without_a_mask_too(tmp_path, monkeypatch, family, cp):
    """On GPU right-padded rows take plain causal attention (``ctx.mask`` None, no [T, T] mask):
    the forked ranks inherit the switch, so the same comparison runs through that branch."""
    monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
    check_family(tmp_path, family, cp)


def check_family(tmp_path, family: str, cp: int, overrides: tuple[str, ...] = ()) -> None:
    torch.set_num_threads(1)
    mcfg = tiny(family, *overrides)
    x = inputs(mcfg)
    ref = model_reference(mcfg, x)
    out = str(tmp_path / "cp.pt")
    run_ranks(_model_worker, cp, (mcfg, x, out), what=f"{family} cp{cp}")
    got = torch.load(out)
    valid = x["valid"]
    err = float((got["logits"] - ref["logits"])[valid].abs().max())
    assert err <= 1e-5 * (1 + float(ref["logits"].abs().max())), f"logits differ by {err:.3g}"
    assert torch.equal(got["routed"][valid], ref["routed"][valid]), "routing records differ per position"
    forced = x["forced_mask"]
    if forced is not None:
        assert torch.equal(got["routed"][forced].sort(-1).values, x["forced"][forced].sort(-1).values), "replay exact"
    assert set(got["grads"]) >= set(ref["grads"])
    for name, g in ref["grads"].items():
        e = float((got["grads"][name] - g).abs().max())
        assert e <= 1e-6 + 1e-4 * float(g.abs().max()), f"{name}: grad differs by {e:.3g}"


# -- the trainer step (FSDP plan, dp x cp) ---------------------------------------------------------

def _step_worker(rank: int, world: int, port: int, family: str, cp: int, cfg, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, cp=cp)
    try:
        full = moe.build_model(moe.CONFIGS[family], moe.SEED)
        apply_activation_checkpointing(full.model.layers, cfg.activation_checkpointing)
        step_and_save(parallelize(full, dims, precision=Precision.of(cfg)), dims, moe.make_batch(model=family), cfg, out)
    finally:
        dist.destroy_process_group()


def step_reference(family: str, cfg=None) -> dict:
    cfg = cfg or moe.tcfg()
    r = moe.reference(moe.make_batch(model=family), cfg, family)
    scale = min(1.0, cfg.grad_clip / (r["grad_norm"] + 1e-6))
    return {**r, "clipped": {n: g * scale for n, g in r["grads"].items()}}


# (family, world, cp, trainer overrides): tiny_moe has 2 heads (cp 2), qwen3_moe 4 (cp 4: kv heads repeated)
STEPS = [("tiny_moe", 2, 2, {}), ("tiny_moe", 4, 2, {"micro_batch_tokens": 16, "activation_checkpointing": "full"}),
         ("tiny_moe", 2, 2, {"pack_sequences": True}), ("qwen3_moe", 4, 4, {"activation_checkpointing": "selective"}),
         # per-row loss aggregation: every cp rank holds the same rows (the row count is not summed cp times)
         ("tiny_moe", 4, 2, {"loss_agg": "seq_mean_token_mean", "clip_low": 0.2, "clip_high": 0.2})]


@pytest.mark.parametrize("family,world,cp,over", STEPS, ids=[f"{f}-w{w}-cp{c}-{'-'.join(o) or 'plain'}"
                                                             for f, w, c, o in STEPS])
def test_trainer_step_with_cp_equals_one_rank(tmp_path, family, world, cp, over):
    torch.set_num_threads(1)
    cfg = dataclasses.replace(moe.tcfg(), **over)
    out = str(tmp_path / "step.pt")
    run_ranks(_step_worker, world, (family, cp, cfg, out), what=f"trainer step {family} cp{cp}")
    got, ref = torch.load(out), step_reference(family, cfg)
    assert_step_matches(got, ref, weights=None, grad_names=False)  # loss, grad norm, clipped grads
    assert list(got["weights"]) == list(ref["weights"])
    for name, w in ref["weights"].items():
        # AdamW's first step moves a weight by lr * g / (|g| + 1e-8): where |g| is near 1e-8 the
        # update itself amplifies float rounding of g, so there the bound is the step size.
        g = ref["clipped"][name]
        bound = torch.where(g.abs() < 1e-6, cfg.lr, 1e-5)
        assert bool(((got["weights"][name] - w).abs() <= bound).all()), f"{name}: weights after AdamW differ"


def test_the_trainer_loop_at_cp2_publishes_the_one_rank_weights(tmp_path):
    """``python -m workers.trainer`` with trainer.parallel.cp=2 on 2 gloo ranks (dp 1 x cp 2: the
    degrees read from the config, ParallelDims.init's cp groups, the loop's metrics) against the
    1-rank loop, two steps, micro-batches and activation checkpointing on."""
    par, ref = loop.run_against_one_rank(tmp_path, 2, 2, tp=1, ep=1, cp=2, micro_batch_tokens=20,
                                         activation_checkpointing="full")
    loop.assert_same_run(par, ref, 2, ("loss", "grad_norm", "aux_loss", "routing_disagreement", "num_loss_tokens",
                                       "mismatch_kl", "expert_load_max_l0"), "cp2")
    assert "tp 1 x cp 2 x ep 1 x dp 1 (gloo, cpu)" in (par.logs_dir / "trainer_0.log").read_text()


def test_bfloat16_compute_with_cp_tracks_the_float32_step(tmp_path):
    """Mixed precision (bf16 forward/backward, so the all-to-alls carry bf16) at cp 2: within bf16
    rounding of the fp32 one-rank step."""
    cfg = dataclasses.replace(moe.tcfg(), dtype="bfloat16")
    out = str(tmp_path / "bf16.pt")
    run_ranks(_step_worker, 2, ("tiny_moe", 2, cfg, out), what="bf16 trainer step cp2")
    got, ref = torch.load(out), step_reference("tiny_moe")
    assert got["stats"]["loss"] == pytest.approx(ref["loss"], rel=0.01)
    assert got["stats"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.01)


def packed_row(mcfg):
    """One row of two packed samples (7 + 9 tokens), per-sample positions."""
    ids = torch.randint(1, mcfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
    seg = torch.tensor([[0] * 7 + [1] * 9])
    return ids, seg, torch.cat([torch.arange(7), torch.arange(9)])[None]


def _packed_worker(rank: int, world: int, port: int, mcfg, out: str) -> None:
    torch.set_num_threads(1)
    dims = gloo_dims(rank, world, port, cp=world)
    try:
        model = MODELS.get(mcfg.family).init(mcfg, torch.float32)
        ids, seg, pos = packed_row(mcfg)
        valid = torch.ones(1, T, dtype=torch.bool)
        cp = SeqShard(group=dims.get_group("cp"), size=world, rank=dims.cp_rank, valid=valid, segment_ids=seg)
        with torch.no_grad():
            res = model(cp.local(ids), position_ids=cp.local(pos), attention_mask=cp.local(valid),
                        segment_ids=cp.local(seg), cp=cp)
        logits = gather(res.logits, world)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


PACKED = [("tiny_moe", 2), ("tiny_moe", 4), ("deepseek_v3", 2), ("glm_moe_dsa", 2)]


@pytest.mark.parametrize("family,cp", PACKED, ids=[f"{f}-cp{c}" for f, c in PACKED])
def test_packed_samples_under_cp_equal_the_samples_alone(tmp_path, family, cp):
    """Packed rows under cp attend per document after the all-to-all (no whole-sequence [T, T] mask;
    tiny_moe at cp 4 has too few heads and gathers keys/values with the chunk's rows of the
    per-document mask; DSA's indexer scores against the per-document mask)."""
    mcfg = tiny(family)
    model = MODELS.get(mcfg.family).init(mcfg, torch.float32)
    ids, _, _ = packed_row(mcfg)
    with torch.no_grad():
        alone = torch.cat([model(ids[:, :7]).logits, model(ids[:, 7:]).logits], dim=1)
    out = str(tmp_path / "packed.pt")
    run_ranks(_packed_worker, cp, (mcfg, out), what=f"packed {family} cp{cp}")
    torch.testing.assert_close(torch.load(out), alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cp,overrides", [(2, ()), (4, ("model.num_heads=2",))], ids=["ulysses-cp2", "gathered-cp4"])
def test_dsa_scores_and_attends_in_query_chunks_with_the_same_numbers(tmp_path, monkeypatch, cp, overrides):
    """glm_moe_dsa under cp with chunks of 3 queries (workers/models/blocks/dsa_cp.py: 48 pairs over 16
    keys; uneven last chunk): index scoring, top-k and the checkpointed per-chunk attention equal the
    one-rank dense reference path, through Ulysses (4 heads) and the gathered keys (2 heads, cp 4)."""
    from workers.models.blocks import dsa_cp

    monkeypatch.setattr(dsa_cp, "CHUNK_PAIRS", 3 * T)
    assert dsa_cp.chunk_rows(T) == 3
    check_family(tmp_path, "glm_moe_dsa", cp, overrides)
