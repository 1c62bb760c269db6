"""The static engine (workers/inference/embedded/static_engine.py) on CPU, where it runs without CUDA
graphs but with the same fixed slots, device-side slot state, chunked prefill and block-wise host
reads as on a GPU.

First the dynamic engine's whole behaviour suite (tests/unit/inference/test_engine.py: greedy and sampled
outputs against no-cache references, logprobs, Router Replay records, stop conditions, pause,
abort, weight updates with per-token versions, a crash) runs again with ``make_engine`` building a
static engine with small chunks and blocks. Then what only the static engine has: chunked prefill
equal to one-shot prefill, admission into a freed slot while others decode, slot reuse over
prompts of different lengths (stale keys masked), top-p, the per-slot length limit, the factory.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import types

import pytest
import torch

import tests.unit.inference.test_engine as dynamic_suite
from tests.unit.inference.test_engine import CFG, PROMPTS, reference_greedy, run
from workers.inference.embedded.static_engine import StaticEngine, create_engine
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.slot_state import MAX_STOP_IDS
from workers.models.tiny_moe.model import build_model


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=3)


def make_static(lm, *, max_batch_size=3, seed=11, **kw) -> StaticEngine:
    opts = dict(max_seq_len=64, prefill_chunk=4, sync_every=3, smallest_key_window=8) | kw  # windows 8..64
    return StaticEngine(lm, max_batch_size=max_batch_size, seed=seed, **opts)


# The dynamic suite's tests, rebound so that every engine they build is a static one.
_globals = dict(vars(dynamic_suite), make_engine=make_static,
                InferenceEngine=lambda lm, *, max_batch_size, seed, **kw: make_static(lm, max_batch_size=max_batch_size,
                                                                                       seed=seed))
for _name, _fn in list(vars(dynamic_suite).items()):
    if _name.startswith("test_") and isinstance(_fn, types.FunctionType):
        globals()[f"{_name}__static"] = types.FunctionType(_fn.__code__, _globals, _name, _fn.__defaults__, _fn.__closure__)


def test_chunked_prefill_equals_one_shot_prefill(model):
    prompts = [list(range(1, 30)), [3, 1, 4, 1, 5, 9, 2, 6], [7]]
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=6, return_routed_experts=True) for p in prompts]
    outs = {c: run(make_static(model, prefill_chunk=c), [dataclasses.replace(r) for r in reqs]) for c in (1, 5, 64)}
    for one, five, whole in zip(outs[1], outs[5], outs[64]):
        assert one.output_ids == five.output_ids == whole.output_ids
        assert torch.equal(one.routed_experts, whole.routed_experts) and torch.equal(five.routed_experts, whole.routed_experts)
        assert max(abs(a - b) for a, b in zip(one.logprobs + five.logprobs, whole.logprobs * 2)) < 1e-5


def test_admission_mid_run_into_a_freed_slot(model):
    """A request submitted while others decode joins at a block boundary and gets exactly its solo
    output; the long-running ones are not disturbed; every slot is free again at the end."""
    engine = make_static(model, max_batch_size=2).start()
    results = {}
    try:
        engine.submit(GenRequest(rid="long", input_ids=PROMPTS[1], temperature=0.0, max_new_tokens=40),
                      lambda o: results.__setitem__(o.rid, o))
        engine.submit(GenRequest(rid="short", input_ids=PROMPTS[0], temperature=0.0, max_new_tokens=3),
                      lambda o: results.__setitem__(o.rid, o))
        deadline = time.monotonic() + 20
        while "short" not in results:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert engine.num_running == 1  # "long" still decodes; "short"'s slot is free
        late = engine.generate([GenRequest(rid="late", input_ids=PROMPTS[4], temperature=0.0, max_new_tokens=9)])[0]
        while "long" not in results:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        engine.shutdown()
    assert late.output_ids == reference_greedy(model, PROMPTS[4], 9)
    assert results["long"].output_ids == reference_greedy(model, PROMPTS[1], 40)
    assert sorted(engine._free) == [0, 1]


def test_slots_are_reused_across_prompt_lengths(model):
    """One slot, long prompts then short ones: the stale keys a longer previous owner left above the
    new prompt are masked (outputs equal the no-cache reference)."""
    prompts = [[i % 30 + 1 for i in range(40)], [5], [6, 7], list(range(9, 30)), [1, 2]]
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=5) for p in prompts]
    outs = run(make_static(model, max_batch_size=1), reqs)
    assert [o.output_ids for o in outs] == [reference_greedy(model, p, 5) for p in prompts]


def test_greedy_equals_the_dynamic_engine_under_continuous_batching(model):
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=n, return_routed_experts=True)
            for p, n in zip(PROMPTS, [6, 3, 9, 5, 2, 7])]
    dyn = run(InferenceEngine(model, max_batch_size=2, seed=0), reqs)
    sta = run(make_static(model, max_batch_size=2), [dataclasses.replace(r) for r in reqs])
    for a, b in zip(dyn, sta):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_top_p_keeps_the_nucleus(model):
    tiny = [GenRequest(input_ids=p, temperature=1.0, top_p=1e-6, max_new_tokens=6) for p in PROMPTS[:3]]
    outs = run(make_static(model), tiny)
    assert [o.output_ids for o in outs] == [reference_greedy(model, p, 6) for p in PROMPTS[:3]]
    wide = run(make_static(model), [dataclasses.replace(r, top_p=1.0) for r in tiny])
    assert [o.output_ids for o in wide] != [o.output_ids for o in outs]  # sampling is on otherwise
    dyn = run(InferenceEngine(model, max_batch_size=3, seed=0), [dataclasses.replace(r) for r in tiny])
    assert [o.output_ids for o in dyn] == [o.output_ids for o in outs]  # the dynamic engine cuts the nucleus too


def test_slot_length_limit_and_refusals(model):
    (out,) = run(make_static(model, max_seq_len=12), [GenRequest(input_ids=PROMPTS[3], temperature=0.0,
                                                                 max_new_tokens=50)])
    assert out.finish_reason == {"type": "length", "length": 12 - len(PROMPTS[3])}
    assert out.output_ids == reference_greedy(model, PROMPTS[3], 12 - len(PROMPTS[3]))
    (bad,) = run(make_static(model), [GenRequest(input_ids=[1], stop_token_ids=tuple(range(MAX_STOP_IDS + 1)))])
    assert bad.error and "stop_token_ids" in bad.error


def test_create_engine_picks_by_device_and_option(model):
    from workers.inference.embedded.config import EmbeddedInferenceConfig

    opts = EmbeddedInferenceConfig(max_seq_len=48, prefill_chunk=7, sync_every=2)
    assert type(create_engine(model, max_batch_size=2, seed=0, options=opts)) is InferenceEngine  # auto on CPU
    on = create_engine(model, max_batch_size=2, seed=0, options=dataclasses.replace(opts, static_cache="on"))
    assert isinstance(on, StaticEngine) and (on.max_seq_len, on.prefill_chunk, on.sync_every) == (48, 7, 2)
    assert not on._use_graphs  # graphs are for CUDA devices
    off = create_engine(model, max_batch_size=2, seed=0, options=dataclasses.replace(opts, static_cache="off"))
    assert type(off) is InferenceEngine


def test_a_layer_the_slots_cannot_hold_falls_back_to_the_dynamic_engine(caplog):
    """Two attention modules in one layer (no builtin family has that): refused by the static cache,
    served by the dynamic engine with a warning naming the layer."""
    import logging

    from workers.inference.embedded.config import EmbeddedInferenceConfig
    from workers.inference.embedded.static_cache import StaticKVCache

    odd = build_model(CFG, seed=3)
    odd.model.layers[1].second = copy.deepcopy(odd.model.layers[1].self_attn)
    with caplog.at_level(logging.WARNING, logger="slurmrl.inference"):
        engine = create_engine(odd, max_batch_size=2, seed=0, options=EmbeddedInferenceConfig(static_cache="on"))
    assert type(engine) is InferenceEngine and "layer 1" in caplog.text and "dynamic engine" in caplog.text
    with pytest.raises(ValueError, match="layer 1"):
        StaticKVCache(odd, num_slots=2, max_len=8, device="cpu", dtype=torch.float32)


def test_a_failed_graph_capture_falls_back_to_eager_decoding(model):
    """On CPU a capture cannot work: forced on, it fails, the engine says why and decodes eagerly."""
    from workers.inference.embedded.cuda_graphs import DecodeGraphs

    engine = make_static(model)
    engine._graphs = DecodeGraphs(engine._decode_step, engine._quiesced, engine.device)
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=5) for p in PROMPTS[:4]]
    outs = run(engine, reqs)
    assert engine.graph_error and engine._graphs is None
    assert [o.output_ids for o in outs] == [reference_greedy(model, p, 5) for p in PROMPTS[:4]]


SYNCING_OPS = {"aten::nonzero", "aten::nonzero_numpy", "aten::_local_scalar_dense", "aten::masked_select", "aten::unique", "aten::equal",
               "aten::is_nonzero", "aten::bincount", "aten::_unique2", "aten::unique_consecutive"}


# nonzero(as_tuple=True) dispatches as aten::nonzero_numpy (torch 2.13): listed so the expert loop is caught.
class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read device data on the host (on CUDA: a sync, which a graph cannot capture)."""

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name.startswith(("aten::index", "aten::index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and
                                                                             isinstance(args[1], (list, tuple)) else ()))
        if name in SYNCING_OPS or bool_index:
            self.hits.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["tiny_moe", "qwen3_moe", "deepseek_v3", "nemotron_h", "glm_moe_dsa"])
def test_the_decode_step_never_reads_the_device_from_the_host(family, monkeypatch):
    """What a CUDA graph captures (forward on the GPU fast path, sampling, records, stop test) has no
    op that needs a device-to-host copy: checked on CPU with the fast path forced on, bf16. (Token
    ids of the prompts stay below every vocabulary here.)"""
    import workers.models.blocks.kernels as kernels
    from tests.models.test_parity_deepseek_v3 import BASE as DSV3
    from workers.common.registry import MODELS

    monkeypatch.setattr(kernels, "FAST_PATH_ON_CPU", True)
    if family == "tiny_moe":
        lm = build_model(CFG, seed=3)
    elif family == "qwen3_moe":  # GQA (grouped query rows), q/k norms, head_dim != hidden/heads
        from tests.models.test_parity_qwen3_moe import BASE

        lm = MODELS.get("qwen3_moe").build(BASE, dtype=torch.float32).init_weights(0)
    else:  # deepseek_v3 (MLA); glm_moe_dsa (+ DSA keys); nemotron_h (Mamba-2 state, grouped LatentMoE)
        from transformers import AutoConfig

        from tests.models.test_parity_glm_moe_dsa import GLM
        from tests.models.test_parity_nemotron_h import HF_KW

        spec = MODELS.get(family)
        hf_kw = {"deepseek_v3": DSV3, "glm_moe_dsa": GLM, "nemotron_h": HF_KW}[family]
        cfg = spec.config(name="t", **spec.from_hf_config(AutoConfig.for_model(family, **hf_kw).to_dict()))
        lm = spec.build(cfg, dtype=torch.float32).init_weights(0)
    lm = lm.to(torch.bfloat16)
    engine = make_static(lm, max_batch_size=4)
    run(engine, [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=3) for p in PROMPTS[:3]])
    spy = _HostReads()
    with torch.inference_mode(), spy:
        for sample in (False, True):
            engine._decode_step(4, 16, sample)
    assert spy.hits == []


def test_graph_warmups_while_requests_run_change_nothing(model):
    """Graphs are captured on first use of a (batch, key window, mode) key, also mid-run; before a
    capture the step runs eagerly with every slot quiesced. A CPU stand-in that runs exactly those
    warm-ups (then replays eagerly) leaves every output equal to the no-cache reference."""
    from workers.inference.embedded.cuda_graphs import WARMUP_RUNS, DecodeGraphs

    class Eager:
        def __init__(self, step, key):
            self.replay = lambda: step(*key)

    class CpuStandIn(DecodeGraphs):
        def _capture(self, key):
            with self.quiesce():
                for _ in range(WARMUP_RUNS):
                    self.step(*key)
            return Eager(self.step, key)

    engine = make_static(model, max_batch_size=2)
    engine._graphs = CpuStandIn(engine._decode_step, engine._quiesced, engine.device)
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=n, return_routed_experts=True)
            for p, n in zip(PROMPTS, [30, 3, 40, 5, 2, 20])]
    outs = run(engine, reqs)
    assert len(engine._graphs.graphs) >= 3 and engine.graph_error is None  # several windows and sizes
    for r, o in zip(reqs, outs):
        assert o.output_ids == reference_greedy(model, r.input_ids, r.max_new_tokens)
        assert torch.equal(o.routed_experts, dynamic_suite.full_forward(model, r.input_ids, o.output_ids, 0.0)[1])
