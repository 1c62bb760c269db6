"""GPU fast paths of tiny_moe and the embedded engine on CUDA (issue 11).

The CUDA tests are skipped where there is no GPU (CI): their last results are in
benchmarks/results/gpu/. The fast path itself (grouped-GEMM experts, causal attention)
also runs on CPU when ``tiny_moe.FAST_PATH_ON_CPU`` is set, so CI still checks it against
the reference loop.
"""
from __future__ import annotations

import pytest
import torch

import workers.models.blocks.kernels as tm
from benchmarks.gpu.common import TINY_MOE, init_on_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none; see benchmarks/results/gpu)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _fast_vs_reference(device: torch.device, monkeypatch) -> None:
    """The fast path computes the reference's function: logits within bf16 rounding, nearly the same
    routing on its own, and, replaying the reference's routing (one flipped top-k choice in a model
    this small moves some gradients by 10 %+), the same gradients within rounding."""
    model = init_on_device(TINY_MOE, device, torch.bfloat16, seed=0)
    ids = torch.randint(0, TINY_MOE.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(3, 40, dtype=torch.bool, device=device)
    mask[1, 30:] = False  # right padding: the causal fast path applies
    outs = {}
    for fast in (False, True):
        monkeypatch.setattr(tm, "FAST_PATH_ON_CPU", fast)
        monkeypatch.setattr(tm, "fast", (lambda x: True) if fast else (lambda x: False))
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask)
        if fast:  # its own routing, then the reference's replayed for the gradients
            assert (out.routed_experts[mask] == outs[False][0].routed_experts[mask]).float().mean() > 0.95
            out = model(ids, attention_mask=mask, forced_experts=outs[False][0].routed_experts)
        (out.logits.float()[mask].square().mean() + out.aux_loss).backward()
        outs[fast] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (ref, gref), (fast, gfast) = outs[False], outs[True]
    assert _rel(fast.logits[mask], ref.logits[mask]) < 2e-2
    assert set(gfast) == set(gref)
    for name in gref:
        assert _rel(gfast[name], gref[name]) < 5e-2, name


def test_fast_path_matches_reference_on_cpu(monkeypatch):
    _fast_vs_reference(torch.device("cpu"), monkeypatch)


def test_stacked_experts_follow_weight_updates(monkeypatch):
    monkeypatch.setattr(tm, "FAST_PATH_ON_CPU", True)
    model = init_on_device(TINY_MOE, torch.device("cpu"), torch.bfloat16, seed=0).eval()
    ids = torch.randint(0, TINY_MOE.vocab_size, (2, 12))
    with torch.inference_mode():
        a = model(ids).logits
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj.mul_(3.0)
    with torch.inference_mode():
        b = model(ids).logits
    monkeypatch.setattr(tm, "FAST_PATH_ON_CPU", False)
    with torch.inference_mode():
        ref = model(ids).logits
    assert not torch.equal(a, b)
    assert _rel(b, ref) < 2e-2


@needs_cuda
def test_fast_path_matches_reference_on_cuda(monkeypatch):
    _fast_vs_reference(torch.device("cuda"), monkeypatch)


@needs_cuda
def test_engine_generates_on_cuda():
    from benchmarks.gpu.bench_inference import engine_generate

    model = init_on_device(TINY_MOE, torch.device("cuda"), torch.bfloat16, seed=0).eval()
    ps = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    outs, _, _ = engine_generate(model, ps, 10, temperature=1.0, routed=True)
    for p, o in zip(ps, outs):
        assert len(o.output_ids) == 10 and len(o.logprobs) == 10
        assert o.routed_experts.device.type == "cpu"
        assert tuple(o.routed_experts.shape) == (len(p) + 10 - 1, TINY_MOE.num_layers, TINY_MOE.top_k)


@needs_cuda
def test_fp8_linear_close_to_reference():
    from benchmarks.gpu.bench_router_replay import fp8_check

    assert fp8_check(torch.device("cuda")) < 0.1


def test_hf_twin_is_the_same_function():
    pytest.importorskip("transformers", reason="transformers is not installed (the GPU image has it)")
    from benchmarks.gpu.hf_equiv import build_hf_twin, check_equivalence

    model = init_on_device(TINY_MOE, torch.device("cpu"), torch.float32, seed=0).eval()
    hf = build_hf_twin(model)
    res = check_equivalence(model, hf, torch.randint(0, TINY_MOE.vocab_size, (2, 24)))
    assert res["logits_rel_err"] < 1e-5


@needs_cuda
def test_delta_tracker_and_nonfinite_screen_on_cuda_equal_the_cpu():
    """The publish path's device code (issue 31): nonzero_static at known counts, sum64 terms summed for
    all tensors at once, byte-view host copies, the _foreach_norm NaN screen: same parts and sums as on CPU."""
    from workers.weights.base import SoloPeers
    from workers.weights.checksums import nonfinite_names
    from workers.weights.delta.tracker import DeltaTracker
    from workers.weights.stream import DictStream

    g = torch.Generator().manual_seed(0)
    cpu = {f"t{i}.weight": torch.randn(64, 33, generator=g) for i in range(12)}
    runs = {}
    for dev in ("cpu", "cuda"):
        state = {n: t.clone().to(dev) for n, t in cpu.items()}
        stream = DictStream(state, dtype=torch.bfloat16)
        tracker = DeltaTracker(stream, stream.metas, SoloPeers())
        sums0 = tracker.reset()
        gg = torch.Generator().manual_seed(1)
        for t in state.values():
            t.add_((torch.randn(t.shape, generator=gg) * 1e-2).to(dev))
        parts, dsum, compared = tracker.diff()
        runs[dev] = (sums0, {n: [(p.positions.tolist(), p.values.float().tolist()) for p in ps]
                             for n, ps in parts.items()}, dsum, compared)
        assert nonfinite_names(state.items()) == []
        state["t3.weight"][5, 7] = float("nan")
        assert nonfinite_names(state.items()) == ["t3.weight"]
    assert runs["cpu"] == runs["cuda"]
