"""Unit tests of the embedded engine against no-cache references of the same tiny model.

Every check compares the continuously-batched, KV-cached engine with a plain full forward:
tokens (greedy), logprobs under the sampling distribution and routed experts; then stop
conditions, pause/abort and in-place weight updates with per-token versions.
"""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import engine_fault
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.base import WeightLoadError
from workers.weights.filesystem.publisher import publish_step

torch.set_num_threads(1)
VOCAB = 32
CFG = TinyMoeConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
                    expert_intermediate_size=64, max_position_embeddings=64)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [3, 1, 4, 1, 5], [9, 9, 2, 6, 5, 3, 5, 8, 9], [7, 7]]
NEW = [6, 3, 9, 5, 2, 7]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3)


def make_engine(model, *, max_batch_size=3, seed=11) -> InferenceEngine:
    # Submitting before start() queues everything, so admission order is deterministic.
    return InferenceEngine(model, max_batch_size=max_batch_size, seed=seed)


@torch.no_grad()
def reference_greedy(model, prompt, n, stop=()):
    ids = list(prompt)
    out = []
    for _ in range(n):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stop:
            break
    return out


@torch.no_grad()
def full_forward(model, prompt, output, temperature):
    """Logprobs of ``output`` under log_softmax(logits / T) and routing of positions [0, seqlen-1)."""
    seq = torch.tensor([list(prompt) + list(output)])
    res = model(seq)
    logits = res.logits[0, len(prompt) - 1:-1].float()
    logp = F.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    lps = logp.gather(1, torch.tensor(output)[:, None]).squeeze(1)
    return lps, res.routed_experts[0, :-1].to(torch.int32)


def run(engine, reqs, timeout_s=30.0):
    engine.start()
    try:
        return engine.generate(reqs, timeout_s=timeout_s)
    finally:
        engine.shutdown()


def test_batched_greedy_matches_no_cache_reference(model):
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=n, return_routed_experts=True)
            for p, n in zip(PROMPTS, NEW)]
    outs = run(make_engine(model), reqs)
    for p, n, o in zip(PROMPTS, NEW, outs):
        assert o.output_ids == reference_greedy(model, p, n)
        assert o.finish_reason == {"type": "length", "length": n}
        lps, routed = full_forward(model, p, o.output_ids, 0.0)
        assert torch.allclose(torch.tensor(o.logprobs), lps, atol=1e-4)
        assert o.routed_experts.shape == (len(p) + n - 1, CFG.num_layers, CFG.top_k)
        assert torch.equal(o.routed_experts, routed)
        assert o.token_versions == [0] * n


def test_sampled_logprobs_and_routing_match_full_forward(model):
    temp = 0.7
    reqs = [GenRequest(input_ids=p, temperature=temp, max_new_tokens=n, return_routed_experts=True,
                       routed_experts_start_len=1) for p, n in zip(PROMPTS, NEW)]
    outs = run(make_engine(model, max_batch_size=4), reqs)
    for p, o in zip(PROMPTS, outs):
        lps, routed = full_forward(model, p, o.output_ids, temp)
        assert (torch.tensor(o.logprobs) - lps).abs().max() < 1e-4
        assert torch.equal(o.routed_experts, routed[1:])
    # Same seed, same schedule -> same samples; another seed -> different ones.
    again = run(make_engine(model, max_batch_size=4), [dataclasses.replace(r) for r in reqs])
    assert [o.output_ids for o in again] == [o.output_ids for o in outs]
    other = run(make_engine(model, max_batch_size=4, seed=12), [dataclasses.replace(r) for r in reqs])
    assert [o.output_ids for o in other] != [o.output_ids for o in outs]


def test_top_p_samples_within_each_requests_nucleus(model):
    """Per-request top_p in one batch: a vanishing nucleus is greedy, a top_p of 0.6 only ever
    draws tokens inside that nucleus of the full-forward distribution (and the logprob stays the
    temperature distribution's), top_p 1 still samples outside it."""
    def nucleus_of(prompt, output, top_p):
        lps, _ = full_forward(model, prompt, output, 1.0)
        logits = model(torch.tensor([list(prompt) + list(output)])).logits[0, len(prompt) - 1:-1].float()
        sp, si = logits.softmax(-1).sort(-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p
        return [set(si[i, keep[i]].tolist()) for i in range(len(output))], lps

    reqs = [GenRequest(input_ids=p, temperature=1.0, top_p=tp, max_new_tokens=8)
            for p in PROMPTS[:3] for tp in (1e-6, 0.6, 1.0)]
    outs = run(make_engine(model, max_batch_size=9), reqs)
    outside = 0
    with torch.no_grad():
        for r, o in zip(reqs, outs):
            assert o.error is None and len(o.output_ids) == 8
            sets, lps = nucleus_of(r.input_ids, o.output_ids, 0.6)
            assert torch.allclose(torch.tensor(o.logprobs), lps, atol=1e-4)
            if r.top_p < 0.01:
                assert o.output_ids == reference_greedy(model, r.input_ids, 8)
            elif r.top_p < 1.0:
                assert all(t in ok for t, ok in zip(o.output_ids, sets)), (o.output_ids, sets)
            else:
                outside += sum(t not in ok for t, ok in zip(o.output_ids, sets))
    assert outside > 0  # top_p 1 is not cut: the check above can fail


def test_stop_tokens_and_max_new_tokens(model):
    prompt = PROMPTS[1]
    ref = reference_greedy(model, prompt, 12)
    j = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])  # first token not seen before
    reqs = [GenRequest(input_ids=prompt, temperature=0.0, max_new_tokens=12, stop_token_ids=(ref[j],)),
            GenRequest(input_ids=prompt, temperature=0.0, max_new_tokens=4, stop_token_ids=(VOCAB - 1,) if
                       VOCAB - 1 not in ref[:4] else ()),
            GenRequest(input_ids=prompt, temperature=0.0, max_new_tokens=0, return_routed_experts=True)]
    stop, length, zero = run(make_engine(model), reqs)
    assert stop.output_ids == ref[:j + 1]  # the stop token is part of the output ...
    assert stop.finish_reason == {"type": "stop", "matched": ref[j]}
    assert len(stop.logprobs) == j + 1 and stop.logprobs[-1] < 0  # ... and has a logprob
    assert length.output_ids == ref[:4] and length.finish_reason == {"type": "length", "length": 4}
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}
    assert zero.routed_experts.shape[0] == len(prompt) - 1


def test_sequence_never_exceeds_max_positions(model):
    prompt = list(range(1, 20)) * 3  # 57 tokens of a 64-position model
    (out,) = run(make_engine(model), [GenRequest(input_ids=prompt, temperature=1.0, max_new_tokens=50)])
    assert len(prompt) + len(out.output_ids) == CFG.max_position_embeddings
    assert out.finish_reason == {"type": "length", "length": CFG.max_position_embeddings - len(prompt)}


def wait_tokens(engine, n, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while engine.num_generated_tokens < n:
        assert time.monotonic() < deadline, "engine made no progress"
        time.sleep(0.005)


def test_pause_in_place_holds_requests_and_new_weights_tag_later_tokens(tmp_path):
    model = build_model(CFG, seed=3)  # its weights get replaced: not the shared fixture
    engine = make_engine(model, max_batch_size=8)
    # A copy of the model whose lm_head is zero: every logit equal, greedy picks token 0.
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    new_state["lm_head.weight"].zero_()
    publish_step(tmp_path, 1, new_state, keep_last=3)
    results = {}
    engine.start()
    try:
        for i, p in enumerate(PROMPTS[:4]):
            engine.submit(GenRequest(input_ids=p, temperature=0.0, max_new_tokens=40, rid=f"r{i}"),
                          lambda o: results.__setitem__(o.rid, o))
        wait_tokens(engine, 8)
        assert engine.pause("in_place") == 4
        frozen = engine.num_generated_tokens
        time.sleep(0.2)
        assert engine.num_generated_tokens == frozen and not results  # nothing moves, nothing dropped
        assert engine.update_weights_from_disk(str(tmp_path / "step_000001"), 7) == 4
        assert engine.weight_version == 7 and engine.num_running == 4
        engine.resume()
        deadline = time.monotonic() + 20
        while len(results) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.shutdown()
    for o in results.values():
        v = o.token_versions
        assert len(o.output_ids) == 40 and v == sorted(v) and v[0] == 0 and v[-1] == 7
        new = [(t, lp) for t, lp, ver in zip(o.output_ids, o.logprobs, v) if ver == 7]
        assert all(t == 0 and abs(lp + math.log(VOCAB)) < 1e-5 for t, lp in new)
        assert o.weight_version == 7


def test_corrupt_weights_are_refused_and_old_weights_keep_serving(tmp_path):
    model = build_model(CFG, seed=3)
    state = {k: v.clone() * 2 for k, v in model.state_dict().items()}
    publish_step(tmp_path, 1, state, keep_last=3)
    shard = tmp_path / "step_000001" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    engine = make_engine(model).start()
    try:
        before = engine.generate([GenRequest(input_ids=PROMPTS[0], temperature=0.0, max_new_tokens=5)])[0]
        with pytest.raises(WeightLoadError, match="checksum"):
            engine.update_weights_from_disk(str(tmp_path / "step_000001"), 1)
        with pytest.raises(WeightLoadError, match="does not exist"):
            engine.update_weights_from_disk(str(tmp_path / "step_000009"), 9)
        after = engine.generate([GenRequest(input_ids=PROMPTS[0], temperature=0.0, max_new_tokens=5)])[0]
    finally:
        engine.shutdown()
    assert engine.weight_version == 0
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs


def test_pause_abort_finishes_in_flight_requests(model):
    engine = make_engine(model, max_batch_size=2).start()
    results = []
    try:
        for p in PROMPTS[:3]:  # two run, one waits in the queue
            engine.submit(GenRequest(input_ids=p, temperature=1.0, max_new_tokens=50), results.append)
        wait_tokens(engine, 4)
        engine.pause("abort")
        assert len(results) == 3 and engine.num_running == 0 and engine.num_pending == 0
        assert all(o.finish_reason["type"] == "abort" for o in results)
        assert any(o.output_ids for o in results)  # running ones keep what they produced
        engine.resume()
        (ok,) = engine.generate([GenRequest(input_ids=[1], temperature=0.0, max_new_tokens=2)])
        assert ok.finish_reason["type"] == "length"
    finally:
        engine.shutdown()


def test_bfloat16_engine_from_config_keeps_float32_logprobs(model):
    from workers.models.build import model_from_config
    mc = TinyMoeConfig(name="tiny_moe", **{f: getattr(CFG, f) for f in ("vocab_size", "hidden_size", "num_layers",
                     "num_heads", "num_experts", "top_k", "expert_intermediate_size", "max_position_embeddings")})
    with pytest.raises(ValueError, match="float32"):
        model_from_config(mc, "float16")
    bf = model_from_config(mc, "bfloat16")
    bf.load_state_dict(model.state_dict())  # casts to bfloat16
    assert next(bf.parameters()).dtype == torch.bfloat16
    (out,) = run(make_engine(bf), [GenRequest(input_ids=PROMPTS[1], temperature=0.0, max_new_tokens=4)])
    lps, _ = full_forward(bf, PROMPTS[1], out.output_ids, 0.0)
    assert out.output_ids == reference_greedy(bf, PROMPTS[1], 4)
    assert all(isinstance(x, float) and x <= 0 for x in out.logprobs)
    assert torch.allclose(torch.tensor(out.logprobs), lps, atol=5e-2)  # bf16 kernels differ cache vs no cache


def test_weights_whose_logits_overflow_are_served_and_report_non_finite_logprobs():
    """A diverged trainer's weights (finite, huge: the logits overflow) do not crash the engine:
    those rows are drawn uniformly and their logprobs are not finite, which the trainer's
    divergence check turns into a stop with its reason (issue 35)."""
    engine = InferenceEngine(build_model(CFG, seed=0), max_batch_size=2, seed=0).start()
    try:
        head = engine.model.state_dict()["lm_head.weight"]
        engine.apply_weights({"lm_head.weight": torch.randn(head.shape).clamp(-3, 3) * 1e38}, 1, source="test")
        outs = engine.generate([GenRequest(input_ids=[1, 2], max_new_tokens=4, temperature=1.0) for _ in range(3)],
                               timeout_s=10)
    finally:
        engine.shutdown()
    assert all(o.error is None and len(o.output_ids) == 4 for o in outs), [o.error for o in outs]
    assert all(0 <= t < CFG.vocab_size for o in outs for t in o.output_ids)
    assert any(not math.isfinite(x) for o in outs for x in o.logprobs)
    assert engine.failure is None


def test_a_crash_in_the_prefill_answers_every_request_with_the_error(monkeypatch):
    """A device fault inside the prefill (injected: tests/helpers/engine_fault.py): the rows being
    admitted (neither queued nor running) and the queued ones all get the error (issue 22)."""
    engine_fault.arm(1, monkeypatch)
    engine = InferenceEngine(build_model(CFG, seed=0), max_batch_size=2, seed=0).start()
    try:
        head = engine.model.state_dict()["lm_head.weight"]
        engine.apply_weights({"lm_head.weight": head * 1.5}, 1, source="test")
        outs = engine.generate([GenRequest(input_ids=[1, 2], max_new_tokens=4, temperature=1.0) for _ in range(5)],
                               timeout_s=10)
        late = engine.generate([GenRequest(input_ids=[1], max_new_tokens=1)], timeout_s=5)  # after the crash
    finally:
        engine.shutdown()
    assert all(o.error and o.error.startswith("engine failed: RuntimeError") for o in outs + late)
    assert not engine.alive and engine.failure.startswith("engine failed")
