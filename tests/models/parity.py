"""Parity against transformers, the reference implementation of every model family.

Each family's test builds transformers' own model from its config class (tiny, float32,
seeded), saves it with ``save_pretrained`` (the checkpoint layout SGLang and the hub use:
per-expert names), loads that state dict into ours with ``strict=True`` and compares:
logits, gradients of a scalar loss, Router Replay, and greedy generation through our embedded
engine against transformers' ``generate``. transformers keeps MoE experts fused in memory
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``); :func:`hf_grads`
splits their gradients back into checkpoint names.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra (pip install -e '.[dev]')")

from workers.models.blocks.experts import checkpoint_named  # noqa: E402

torch.set_num_threads(1)

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def hf_reference(hf_config, tmp_path: Path, seed: int = 0, norm_jitter: float = 0.1, prepare=None):
    """(transformers model in float32 eval mode, the directory it was saved to).

    transformers initialises every norm weight to 1, which would hide a norm applied to the wrong
    axis or not at all; ``norm_jitter`` scales them by ``1 + jitter * N(0, 1)`` before saving.
    ``prepare(model)`` may change the weights further before saving (e.g. scale them up so that no
    path's contribution is lost in float32 rounding against the residual stream)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + norm_jitter * torch.randn_like(p))
    if prepare is not None:
        with torch.no_grad():
            prepare(hf)
    out = Path(tmp_path) / "hf"
    hf.save_pretrained(out)
    return hf, out


def checkpoint_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint (one file or a sharded index), by checkpoint name."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def load_into(ours: torch.nn.Module, model_dir: Path, from_hf=lambda s: s) -> torch.nn.Module:
    """Our model with the checkpoint's weights: no missing or unexpected keys."""
    ours.load_state_dict(from_hf(checkpoint_state(model_dir)), strict=True)
    return ours.float().eval()


def hf_logits(hf, ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    return hf(input_ids=ids, attention_mask=attention_mask).logits


def assert_logits_match(ours, hf, ids: torch.Tensor, attention_mask=None, rtol: float = LOGITS_RTOL) -> float:
    with torch.no_grad():
        want = hf_logits(hf, ids, attention_mask)
        got = ours(ids, attention_mask=attention_mask).logits
    if attention_mask is not None:  # pad positions are unspecified in both
        m = attention_mask.bool()
        want, got = want[m], got[m]
    err = rel_err(got, want)
    assert err <= rtol, f"logits relative error {err:.2e} > {rtol:.0e}"
    return err


_FUSED = re.compile(r"^(?P<pre>.*experts)\.(?P<kind>gate_up_proj|down_proj|up_proj)$")


def hf_grads(hf, rename=lambda name: name, split_experts: bool = True) -> dict[str, torch.Tensor]:
    """Gradients of transformers' parameters under checkpoint names (fused experts split per expert,
    unless ``split_experts`` is off: GPT-OSS's checkpoints keep them fused, and so does our model).
    ``rename``: in-memory name -> checkpoint name where save_pretrained renames (NemotronH's
    ``model.`` is ``backbone.`` in its checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        name = rename(name)
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        m = _FUSED.match(base) if split_experts else None
        if m is None or p.grad.dim() != 3:
            out[name] = p.grad
            continue
        for e in range(p.grad.shape[0]):
            g = p.grad[e]
            if m["kind"] == "gate_up_proj":
                half = g.shape[0] // 2
                out[f"{m['pre']}.{e}.gate_proj.weight"] = g[:half]
                out[f"{m['pre']}.{e}.up_proj.weight"] = g[half:]
            else:
                out[f"{m['pre']}.{e}.{m['kind']}.weight"] = g
    return out


def scalar_loss(logits: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every logit differently (so a wrong gradient anywhere shows)."""
    w = torch.linspace(-1.0, 1.0, logits.numel(), dtype=logits.dtype).view_as(logits)
    return (logits * w).sum() + logits.logsumexp(-1).sum()


def assert_grads_match(ours, hf, ids: torch.Tensor, rtol: float = GRAD_RTOL, to_hf=lambda s: s,
                       rename=lambda name: name, split_experts: bool = True) -> float:
    """Every parameter's gradient of :func:`scalar_loss`, ours vs transformers'; returns the worst error."""
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    scalar_loss(ours(ids).logits).backward()
    scalar_loss(hf(input_ids=ids).logits).backward()
    want = hf_grads(hf, rename, split_experts)
    got = to_hf(checkpoint_named(ours, {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}))
    # An expert no token chose has no gradient in ours, a zero one in transformers' fused tensor.
    missing = sorted(n for n in set(want) - set(got) if want[n].norm() > 0)
    assert not missing, f"no gradient in ours for {missing[:5]}"
    worst, errs = 0.0, []
    for name, g in want.items():
        if g.norm() == 0:
            assert name not in got or got[name].norm() == 0, f"{name}: gradient in ours, none in transformers"
            continue
        err = rel_err(got[name], g)
        worst = max(worst, err)
        if err > rtol:
            errs.append(f"{name}: {err:.2e}")
    assert not errs, f"gradient relative error > {rtol:.0e}: {errs[:5]}"
    return worst


def assert_router_replay(ours, ids: torch.Tensor) -> None:
    """Forcing the routing the model chose reproduces its logits exactly; forcing other experts changes them."""
    with torch.no_grad():
        free = ours(ids)
        assert free.routed_experts.shape[2] == ours.num_routed_layers > 0
        same = ours(ids, forced_experts=free.routed_experts)
        assert torch.equal(same.logits, free.logits), "replaying the model's own routing changed its logits"
        num_experts = int(free.expert_load.shape[1])
        other = (free.routed_experts + 1) % num_experts
        changed = ours(ids, forced_experts=other)
        assert not torch.allclose(changed.logits, free.logits), "forcing other experts left the logits unchanged"
        assert torch.equal(changed.routed_experts, other), "routed_experts must report the forced experts"


def assert_engine_greedy_matches_hf(ours, hf, prompts: list[list[int]], max_new_tokens: int = 6,
                                    max_batch_size: int = 2, make_engine=None) -> None:
    """Our embedded engine (left-padded prefill, KV cache, continuous batching) produces exactly
    transformers' greedy ``generate`` tokens for each prompt. ``make_engine(model, max_batch_size=,
    seed=)``: another engine class (the static one), default the dynamic InferenceEngine."""
    from workers.inference.embedded.engine import GenRequest, InferenceEngine

    engine = (make_engine or InferenceEngine)(ours, max_batch_size=max_batch_size, seed=0).start()
    try:
        outs = engine.generate([GenRequest(rid=str(i), input_ids=p, max_new_tokens=max_new_tokens, temperature=0.0)
                                for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.output_ids == ref[0, len(p):].tolist(), f"prompt {p}: ours {out.output_ids}, transformers {ref[0, len(p):].tolist()}"


def assert_from_pretrained_loads(ours, hf_config: dict, tmp_path: Path, ids: torch.Tensor,
                                 rtol: float = LOGITS_RTOL) -> float:
    """A directory written from OUR model (``state_dict()`` as model.safetensors + the family's
    ``to_hf_config`` as config.json) is what a published step holds: transformers'
    ``AutoModelForCausalLM.from_pretrained`` must load it with no missing, unexpected or
    mis-shaped keys, as the architecture config.json names, and compute our logits."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / "ours"
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in ours.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == hf_config["architectures"][0]
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not problems, f"from_pretrained of our checkpoint: {problems}"
    return assert_logits_match(ours, hf.eval(), ids, rtol=rtol)
