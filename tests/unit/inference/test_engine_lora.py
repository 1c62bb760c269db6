"""LoRA adapters on the embedded engine (workers/inference/embedded/lora.py), unmerged.

What must hold: the engine with base + adapter computes what a model with the adapter merged into its
weights computes (dense targets and routed-expert stacks, dynamic and static engine, several adapters in
one batch); an adapter step published by the trainer's publisher loads through the same route a full
step does, version by version, and the engine's digest (its buffers read back) equals the trainer's;
a delivery that silently did nothing shows the old digest; a bad adapter is refused, the old one kept.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.inference.test_engine import CFG, PROMPTS, reference_greedy, run
from workers.common.protocol import step_name
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.lora import EngineLora
from workers.inference.embedded.static_engine import StaticEngine
from workers.models.tiny_moe.model import build_model
from workers.weights.base import SoloPeers, WeightLoadError
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.lora_format import Adapter
from workers.weights.lora_publisher import AdapterPublisher
from workers.weights.lora_steps import expected_digest, file_digest

TARGETS = ("q_proj", "v_proj", "o_proj", "experts")


def random_adapter(lora: EngineLora, rank: int, seed: int, alpha: float = 8.0) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in {**lora.dense, **lora.stacks}.items():
        lead = tuple(p.a.shape[:-2])
        tensors[name] = (torch.randn(*lead, rank, p.a.shape[-1], generator=g) * 0.3,
                         torch.randn(*lead, p.b.shape[-2], rank, generator=g) * 0.3)
    return Adapter(tensors, rank=rank, alpha=alpha)


def merged(model, adapter: Adapter):
    """The reference: a copy of ``model`` with every adapter delta added to its weights."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for target in adapter.tensors:
            mod, _, leaf = target.rpartition(".")
            owner = ref.get_submodule(target) if leaf.endswith("_proj") and not mod.endswith("experts") else None
            w = owner.weight if owner is not None else getattr(ref.get_submodule(mod), leaf)
            w.add_(adapter.delta(target).to(w.dtype))
    return ref


@pytest.fixture()
def base():
    return build_model(CFG, seed=3)


def test_unmerged_forward_equals_merged_weights(base):
    """Dense and expert targets, rank below the slots' (zero-padded), two adapters and the base in one batch."""
    model = copy.deepcopy(base)
    lora = EngineLora(model, rank=4, targets=TARGETS, num_adapters=2, names=["a", "b"])
    ad_a, ad_b = random_adapter(lora, 3, seed=1), random_adapter(lora, 4, seed=2, alpha=2.0)
    lora.load(ad_a, slot=0)
    lora.load(ad_b, slot=1)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]] * 3)
    lora.use(torch.tensor([lora.index("a"), lora.index("b"), lora.index("base")]))
    with torch.no_grad():
        got = model(ids).logits
        want = [merged(base, ad_a)(ids[:1]).logits[0], merged(base, ad_b)(ids[:1]).logits[0], base(ids[:1]).logits[0]]
    for row, ref in enumerate(want):
        assert (got[row] - ref).abs().max() < 1e-5, row
    assert (want[0] - want[2]).abs().max() > 1e-2  # the adapter changes the output (the test can fail)
    assert lora.digest(0) != lora.digest(1)


@pytest.mark.parametrize("engine_cls", [InferenceEngine, StaticEngine])
def test_engines_generate_what_the_merged_model_generates(base, engine_cls):
    """Greedy tokens of both engines (the static one on its fixed slots: the CUDA-graph code path on CPU)
    equal the merged model's no-cache reference; a request for 'base' gets the base model's."""
    model = copy.deepcopy(base)
    lora = EngineLora(model, rank=4, targets=TARGETS)
    adapter = random_adapter(lora, 4, seed=5)
    lora.load(adapter)
    kw = dict(max_seq_len=64, prefill_chunk=4, sync_every=3, smallest_key_window=8) if engine_cls is StaticEngine else {}
    engine = engine_cls(model, max_batch_size=3, seed=0, lora=lora, **kw)
    reqs = [GenRequest(input_ids=p, temperature=0.0, max_new_tokens=5) for p in PROMPTS[:3]]
    reqs.append(GenRequest(input_ids=PROMPTS[3], temperature=0.0, max_new_tokens=5, adapter="base"))
    outs = run(engine, reqs)
    ref = merged(base, adapter)
    for out, p in zip(outs[:3], PROMPTS[:3]):
        assert out.output_ids == reference_greedy(ref, p, 5)
    assert outs[3].output_ids == reference_greedy(base, PROMPTS[3], 5)


def publish_base_and_adapters(root, base, adapters):
    pub = AdapterPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=2), root, peers=SoloPeers(),
                           keep_last=2)
    try:
        pub.publish(0, base.state_dict())
        for v, ad in enumerate(adapters, start=1):
            pub.publish(v, ad)
    finally:
        pub.close()


def test_adapter_steps_load_version_by_version_and_confirm(tmp_path, base):
    """Step 0 is the base, steps 1.. adapters (the trainer's publisher); the engine loads each through
    update_weights_from_disk, answers the trainer's digest, and tags tokens with the version; retention
    keeps the base; a silent no-op delivery reports the old digest; a bad adapter is refused."""
    model = build_model(CFG, seed=99)  # wrong weights until step 0 loads
    lora = EngineLora(model, rank=4, targets=TARGETS)
    ads = [random_adapter(lora, 4, seed=s) for s in (11, 12, 13)]
    root = tmp_path / "weights"
    publish_base_and_adapters(root, base, ads)
    assert sorted(d.name for d in root.iterdir()) == [step_name(0), step_name(2), step_name(3)]  # keep_last=2
    engine = InferenceEngine(model, max_batch_size=2, seed=0, lora=lora)
    engine.update_weights_from_disk(str(root / step_name(0)), 0)
    for v in (2, 3):
        step = root / step_name(v)
        n, digest = engine.load_adapter(str(step), v)
        assert digest == expected_digest(step) == file_digest(step / "adapter_model.safetensors")
        ref = merged(base, ads[v - 1])
        engine.start()
        out = engine.generate([GenRequest(input_ids=PROMPTS[1], temperature=0.0, max_new_tokens=4)])[0]
        engine.shutdown()
        engine = InferenceEngine(model, max_batch_size=2, seed=0, lora=lora, weight_version=v)
        assert out.output_ids == reference_greedy(ref, PROMPTS[1], 4) and set(out.token_versions) == {v}
    held = lora.digest()
    # a delivery that did nothing (verl #7495): the engine then reports what it really serves
    lora.load = lambda *a, **k: None
    _, digest = engine.load_adapter(str(root / step_name(2)), 4)
    assert digest == held != expected_digest(root / step_name(2))
    del lora.load
    big = random_adapter(EngineLora(copy.deepcopy(base), rank=8, targets=TARGETS), 8, seed=3)
    publish_base_and_adapters(tmp_path / "w2", base, [big])
    with pytest.raises(WeightLoadError, match="rank 8 > the engine's 4"):
        engine.load_adapter(str(tmp_path / "w2" / step_name(1)), 5)
    assert lora.digest() == held
