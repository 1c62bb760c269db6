"""The planner's activation estimate (launcher/activations.py) against a real trainer step, and the
plan's refusal of a layout whose states + activations do not fit 90% of a GPU.

The measured side is benchmarks/long_context.py's: one packed row through the trainer's step
(FSDP plan, Router Replay, chunked log-probs) in a fresh spawned process, peak resident memory
of the step minus the resident memory before it (issue 19 item 6, issue 20 item 5)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from benchmarks.gpu.common import TINY_MOE
from benchmarks.long_context import RESULTS, measure
from launcher.activations import activation_memory
from launcher.plan import PlanError, build_plan
from tests.conftest import compose


@pytest.mark.slow  # measures a real trainer step in a fresh process
@pytest.mark.parametrize("ac, chunk", [("full", 512), ("none", 4096), ("selective", 512)])
def test_estimate_is_within_25_percent_of_the_measured_cpu_peak(ac, chunk, tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed activations leave the RSS (as the benchmark)
    t = 4096
    cfg = dataclasses.replace(TINY_MOE, max_position_embeddings=t)
    got = measure(t, 1, argparse.Namespace(ac=ac, chunk=chunk, model=cfg, dtype="float32"), tmp_path)
    est = activation_memory(cfg, tokens=t, ac=ac, compute_dtype="float32", logprob_chunk=chunk)
    assert est.total_bytes == pytest.approx(got["peak_bytes_per_rank"], rel=0.25), est.detail
    assert RESULTS.is_dir()


def test_checkpointing_and_context_parallel_shrink_the_estimate():
    m = compose(["model=gpu_moe_1b5"]).model
    none, full = (activation_memory(m, tokens=131072, ac=ac).total_bytes for ac in ("none", "full"))
    assert full < none / 5
    cp4 = activation_memory(m, tokens=131072, ac="full", cp=4)
    assert cp4.tokens == 32768 and cp4.total_bytes < full / 3
    assert cp4.indexer_bytes == 0
    glm5 = compose(["model=glm5"]).model
    dense = activation_memory(dataclasses.replace(glm5, dsa_chunk_tokens=0), tokens=131072, ac="full")
    assert dense.indexer_bytes == 131072 * 131072 * (32 * 4 + 7) and "dense reference" in dense.detail  # quadratic
    dense_cp = activation_memory(dataclasses.replace(glm5, dsa_chunk_tokens=0), tokens=131072, ac="full", cp=8)
    pairs = 256 * 131072  # the dense path under cp (dsa_cp.py): chunks of 2**25 pairs, topk indices
    assert dense_cp.indexer_bytes == pairs * (32 * 4 + 13) + (131072 + 16384) * 2048 * 8 + pairs * 7
    assert "chunks of 33554432 pairs" in dense_cp.detail
    dsa = activation_memory(glm5, tokens=131072, ac="full", cp=8)  # memory-linear: one chunk + the chosen positions
    chunk = 256 * 131072 * (2 * 32 * 4 + 9) + 256 * 2048 * (2 * 576 * 2 + 4 * 64 * 4) + 2 * 131072 * 576 * 2
    assert dsa.indexer_bytes == chunk + 16384 * 2048 * 4 and "query chunks of 256" in dsa.detail
    assert dsa.indexer_bytes < dense.indexer_bytes / 25
    half = activation_memory(compose(["model=glm5"]).model, tokens=65536, ac="full", cp=4)  # same queries, half the keys
    assert half.indexer_bytes < 0.6 * dsa.indexer_bytes  # linear in the keys, not quadratic
    small_chunk = activation_memory(m, tokens=131072, ac="none", logprob_chunk=1024, logprob_head="fused")
    assert small_chunk.head_bytes * 4 == activation_memory(m, tokens=131072, ac="none", logprob_head="fused").head_bytes
    held = activation_memory(m, tokens=131072, ac="none", logprob_head="fused_loss").head_bytes  # fused_loss: + the float32 [V, H] gradient
    assert held == activation_memory(m, tokens=131072, ac="none", logprob_head="fused").head_bytes \
        + 4 * m.vocab_size * m.hidden_size


LONG = ["cluster=h200_ib", "model=gpu_moe_1b5", "model.max_position_embeddings=131072", "trainer.micro_batch_tokens=131072"]


def test_a_layout_that_does_not_fit_is_refused_with_the_numbers():
    with pytest.raises(PlanError, match=r"trainer does not fit its GPUs with the activations of its largest forward: "
                                        r"states 23\.6 GB \(16 B/param x 1\.5B params / 1 GPUs\) \+ activations .* of 126\.9 \(90% of 141\); "
                                        r"use trainer\.activation_checkpointing=full"):
        build_plan(compose([*LONG, "launcher.dry_run=false", "trainer.activation_checkpointing=none"]))
    dry = build_plan(compose([*LONG, "trainer.activation_checkpointing=none"]))  # a dry run plans, and warns
    assert any("does not fit" in w and "a real run is refused" in w for w in dry.trainer_dims.warnings)
    fits = build_plan(compose([*LONG, "launcher.dry_run=false", "trainer.activation_checkpointing=full"]))
    (mem,) = [m for m in fits.memory if m.what == "trainer"]
    assert mem.fits and "states 23.6 GB (16 B/param x 1.5B params / 1 GPUs) + activations" in mem.detail and "131072 tokens/GPU" in mem.detail
    assert any(line.startswith("memory trainer: states") for line in fits.summary())


def test_without_micro_batches_the_whole_rank_batch_is_one_forward():
    """micro_batch_tokens 0: every row of the rank's share of the step at once (128 rows of up to 1024
    tokens on one GPU here), so the plan counts them all and names the micro-batch budget as a cure."""
    base = ["cluster=h200_ib", "model=gpu_moe_1b5", "model.max_position_embeddings=1024", "launcher.dry_run=false"]
    one = build_plan(compose([*base, "trainer.micro_batch_tokens=1024"]))
    (mem,) = [m for m in one.memory if m.what == "trainer"]
    assert "1024 tokens/GPU (1024 per forward / cp 1)" in mem.detail
    with pytest.raises(PlanError, match=r"131072 tokens/GPU \(131072 per forward.*trainer\.micro_batch_tokens=1024 "
                                        r"\(one longest sample per forward\)"):
        build_plan(compose([*base, "trainer.micro_batch_tokens=0", "model.max_position_embeddings=1024"]))


def test_fixed_capacity_dispatch_grows_the_routed_expert_activations():
    """ep_capacity_factor 2 runs the routed experts over twice the slots (padding): more bytes kept
    without checkpointing; at ep 1 or factor 0 (exact dispatch) nothing changes."""
    from launcher.activations import dispatch_rows

    m = compose(["model=gpu_moe_1b5"]).model
    assert dispatch_rows(1, 2.0) == dispatch_rows(4, 0.0) == 1.0 and dispatch_rows(4, 2.0) == 2.0
    exact, fixed = (activation_memory(m, tokens=16384, ac="none", routed_rows=r).total_bytes for r in (1.0, 2.0))
    assert exact < fixed < 2 * exact
    sel = {ep: activation_memory(m, tokens=16384, ac="selective", routed_rows=2.0, ep=ep).total_bytes for ep in (1, 2)}
    full = {ep: activation_memory(m, tokens=16384, ac="full", routed_rows=2.0, ep=ep).total_bytes for ep in (1, 2)}
    assert sel[2] > sel[1] and full[2] == full[1], "selective alone keeps the exchanged rows"


def test_the_loss_in_forward_head_is_counted_only_where_the_step_takes_it():
    """fused_loss (the default) holds the head weight's float32 gradient from forward to backward, but
    only where the loss is per-token (workers/trainer/head_loss.py applies): GSPO's geometric ratios or
    an entropy bonus fall back to the two-pass head, and the plan counts that head."""
    from launcher.activations import trainer_fit

    base = ["cluster=h200_ib", "model=gpu_moe_1b5", "trainer.micro_batch_tokens=4096"]

    def gb(*extra):
        cfg = compose([*base, *extra])
        return trainer_fit(cfg, 0.0, 1000.0, num_ranks=1, rows_per_rank=4)[0], cfg.model

    one_pass, m = gb()
    two_pass, _ = gb("trainer.logprob_head=fused")
    held = 4 * m.vocab_size * m.hidden_size / 1e9
    assert one_pass == pytest.approx(two_pass + held, rel=1e-6)
    assert gb("trainer.ratio_level=geometric")[0] == pytest.approx(two_pass, rel=1e-6)
    assert gb("trainer.entropy_coef=0.01")[0] == pytest.approx(two_pass, rel=1e-6)
