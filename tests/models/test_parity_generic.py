"""The generic transformers path (workers/models/hf_generic) against transformers itself.

Two architectures no native family covers, built tiny by transformers into tmp: Phi (partial
rotary from a non-persistent buffer, an lm_head with a bias: the chunked head) and GPT-2 (learned
positions, a tied head: the fused log-prob head, names under ``transformer.h``). Our model is
loaded the way the trainer loads it (built on meta, streamed from the directory) and must give
transformers' logits, the log-probs of the fused / chunked head and transformers' gradients;
packed rows must score as the unpacked ones; activation checkpointing + compiled layers must not
change a gradient; and greedy generation through the embedded engine's generic mode (left-padded
prefills joining a running batch) must equal transformers' ``generate`` prompt by prompt.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.hf_dirs import generic_dir
from tests.models.parity import rel_err
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.inference.embedded.static_engine import create_engine
from workers.models.blocks.logprobs import Scoring
from workers.models.hf_dir import model_fields
from workers.trainer.packing import plan_packing

transformers = pytest.importorskip("transformers")

KINDS = ("phi", "gpt2")


def load_pair(kind: str, directory):
    """(our model loaded from a fresh tiny checkpoint as the trainer loads it, transformers' model
    from the same directory, kind)."""
    from workers.models.hf_generic.model import init

    directory = generic_dir(directory, kind)
    spec, fields = model_fields(directory)
    assert spec.name == "hf_generic"
    cfg = spec.config(name=kind, path=str(directory), **fields)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return init(cfg, torch.float32), hf, kind


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    return load_pair(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def batch():
    """Two right-padded rows (lengths 11 and 7), their mask, and the positions scored (all but the last valid)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False
    need = mask.clone()
    need[0, -1] = need[1, 6] = False
    return ids, mask, need


def scorer(logits, targets):
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1).detach()


def test_logits_logprobs_and_gradients_match_transformers(pair):
    ours, hf, kind = pair
    ids, mask, need = batch()
    want = hf(input_ids=ids, attention_mask=mask).logits
    got = ours(ids, attention_mask=mask).logits
    assert rel_err(got[mask], want[mask]) < 1e-6
    assert ours.plain_head == (kind == "gpt2")  # Phi's lm_head bias: not the fused head
    assert ours.self_check() < 1e-6  # what the engine checks at start
    ours.logit_ops, ours.plain_head = (("logit_scale", 2.0),), False  # a head transformers' class does not have
    with pytest.raises(ValueError, match="logits differ from transformers' own forward"):
        ours.self_check()
    ours.logit_ops, ours.plain_head = (), kind == "gpt2"
    targets = ids[:, 1:][need[:, :-1]]
    ref = F.log_softmax(want[need], -1).gather(-1, targets[:, None]).squeeze(-1)
    for chunk in (0, 3):
        score = Scoring(targets=targets, scorer=scorer, chunk_tokens=chunk, fused_temperature=1.0)
        out = ours(ids, attention_mask=mask, logits_mask=need, score=score)
        assert out.logits is None and out.routed_experts.shape == (2, 11, 0, 0)
        assert rel_err(out.logp, ref) < 1e-5, (kind, chunk)
    ours.zero_grad()
    hf.zero_grad()
    score = Scoring(targets=targets, scorer=scorer, chunk_tokens=4, fused_temperature=1.0)
    ours(ids, attention_mask=mask, logits_mask=need, score=score).logp.sum().backward()
    ref_logp = F.log_softmax(hf(input_ids=ids, attention_mask=mask).logits[need], -1)
    ref_logp.gather(-1, targets[:, None]).sum().backward()
    theirs = dict(hf.named_parameters())
    names = [n for n, _ in ours.named_parameters()]
    assert names and set(names) <= set(theirs)
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) < 1e-4, name


def test_packed_rows_score_as_the_unpacked_ones(pair):
    """segment_ids (trainer.pack_sequences): positions restart per sample, attention stays inside it."""
    ours, _, _ = pair
    ids, mask, _ = batch()
    p = plan_packing(mask, row_len=20)
    assert p.pack(ids).shape == (1, 20)  # both rows share one packed row
    with torch.no_grad():
        rows = ours(ids, attention_mask=mask).logits
        packed = ours(p.pack(ids), position_ids=p.position_ids, attention_mask=p.attention_mask,
                      segment_ids=p.segment_ids).logits
    assert rel_err(p.unpack(packed)[mask], rows[mask]) < 1e-6


def test_checkpointed_compiled_layers_give_the_eager_gradients(tmp_path):
    """trainer.activation_checkpointing=full + trainer.compile=layers (aot_eager: the tracing of inductor),
    on GPT-2 only (the wrappers are the same for any architecture; each compile costs CI seconds)."""
    import copy

    from workers.trainer.compile import apply_compile, compiled
    from workers.trainer.micro import apply_activation_checkpointing

    ours, _, _ = load_pair("gpt2", tmp_path / "ckpt")
    wrapped = copy.deepcopy(ours)
    apply_activation_checkpointing(wrapped.model.layers, "full")
    apply_compile(wrapped.model.layers, "layers", backend="aot_eager")
    assert all(compiled(layer) for layer in wrapped.model.layers)
    ids, mask, need = batch()
    for model in (ours, wrapped):
        model.zero_grad()
        model(ids, attention_mask=mask).logits[need].logsumexp(-1).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), wrapped.parameters()):
        assert rel_err(b.grad, a.grad) < 1e-5, name


def test_greedy_generation_through_the_engine_equals_transformers_generate(pair):
    ours, hf, kind = pair
    # two rows at a time: a request joins the running batch when one leaves (left-padded caches merged)
    engine = create_engine(ours, max_batch_size=2, seed=0)  # CPU, static_cache auto: the dynamic engine
    assert type(engine) is InferenceEngine
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 12], [7]]
    engine.start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=p, max_new_tokens=n, temperature=0.0)
                                for i, (p, n) in enumerate(zip(prompts, (4, 9, 6, 12)))])
    finally:
        engine.shutdown()
    for prompt, out in zip(prompts, outs):
        n = len(out.output_ids)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert out.output_ids == want, (kind, prompt)
        logits = hf(input_ids=torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
        ref = F.log_softmax(logits, -1).gather(-1, torch.tensor(want)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)
