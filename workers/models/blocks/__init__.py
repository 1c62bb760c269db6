"""Building blocks shared by every model family (workers/models/<family>/ composes them).

- cache.py: the one inference cache (attention keys/values per layer, recurrent state per layer,
  key validity mask) with the batch operations the embedded engine needs.
- decoder.py: the causal-LM skeleton (embedding, layers, final norm, lm_head) and its forward
  contract (masks, positions, packing, logits_mask, Router Replay, routing records); a family
  supplies its layers, each ``forward(x, ctx) -> (x, Routing | None)``.
Attention kinds, routers, experts and mixers live beside these, one file each:
- norm.py (RMSNorm), mlp.py (SwiGLU MLP / expert), attention.py (GQA with optional per-head q/k
  norms and a free head_dim, rotary, KV cache), moe_softmax.py (softmax top-k MoE with
  norm_topk_prob, grouped-GEMM fast path), router_sigmoid.py (DeepSeek-V3's grouped sigmoid router),
  layer.py (the pre-norm attention + MLP decoder layer of Llama / Qwen3 / Qwen2 / Mistral / Qwen3-MoE /
  tiny_moe), masking.py (sliding-window bands and attention sinks as one more key), kernels.py /
  varlen.py / ulysses.py (the attention paths: SDPA, packed documents, context parallel).
"""
