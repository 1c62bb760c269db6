"""The transformers twin of a tiny_moe model: Qwen3MoeForCausalLM with the same shapes and weights.

tiny_moe follows the HF Qwen3-MoE layout and math (RMSNorm in fp32, rotate-half RoPE
computed in fp32, softmax router -> top-k -> renormalised weights, SwiGLU experts, no
biases, untied lm_head) with two differences, both removed here:
- Qwen3-MoE has per-head RMSNorms on queries and keys (``q_norm``, ``k_norm``); tiny_moe has
  none, so they are replaced by ``nn.Identity`` (an RMSNorm with weight 1 is not an identity);
- transformers 5 stores each layer's experts fused, ``experts.gate_up_proj [E, 2I, H]`` (gate
  rows first) and ``experts.down_proj [E, H, I]``, as tiny_moe does in memory; tiny_moe's state
  dict has the checkpoint's per-expert names (``experts.N.gate_proj.weight``), so the weights are
  stacked on the way over.
Everything else maps by name. ``check_equivalence`` measures the logits' relative error.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from workers.models.tiny_moe.model import TinyMoeForCausalLM


def hf_config(cfg):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.top_k * cfg.expert_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=True,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, decoder_sparse_step=1,
        mlp_only_layers=[], output_router_logits=False, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def hf_state_dict(model: TinyMoeForCausalLM) -> dict[str, torch.Tensor]:
    """tiny_moe state dict -> Qwen3-MoE (transformers 5, fused experts) state dict."""
    sd = model.state_dict()
    out, experts = {}, {}
    pat = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    for name, t in sd.items():
        m = pat.fullmatch(name)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for layer, parts in experts.items():
        n = len(parts["gate_proj"])
        gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
        up = torch.stack([parts["up_proj"][e] for e in range(n)])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out


def build_hf_twin(model: TinyMoeForCausalLM, experts_implementation: str | None = None):
    """A Qwen3MoeForCausalLM on the model's device and dtype holding the same weights."""
    from transformers import Qwen3MoeForCausalLM

    p = next(model.parameters())
    hc = hf_config(model.config)
    if experts_implementation:
        hc._experts_implementation = experts_implementation
    old = torch.get_default_dtype()
    torch.set_default_dtype(p.dtype)
    try:
        with torch.device(p.device):
            hf = Qwen3MoeForCausalLM(hc)
    finally:
        torch.set_default_dtype(old)
    for layer in hf.model.layers:
        layer.self_attn.q_norm = nn.Identity()
        layer.self_attn.k_norm = nn.Identity()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if "rotary" not in m], missing  # inv_freq buffers are not weights
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


@torch.no_grad()
def check_equivalence(model: TinyMoeForCausalLM, hf, input_ids: torch.Tensor) -> dict:
    a = model(input_ids).logits.float()
    b = hf(input_ids=input_ids).logits.float()
    return {"logits_rel_err": float((a - b).norm() / b.norm()), "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "dtype": str(next(model.parameters()).dtype), "experts_implementation": hf.config._experts_implementation,
            "attn_implementation": hf.config._attn_implementation}
