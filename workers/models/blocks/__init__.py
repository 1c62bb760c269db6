"""Building blocks shared by every model family (workers/models/<family>/ composes them).

- cache.py: the one inference cache (attention keys/values per layer, recurrent state per layer,
  key validity mask) with the batch operations the embedded engine needs.
- decoder.py: the causal-LM skeleton (embedding, layers, final norm, lm_head) and its forward
  contract (masks, positions, packing, logits_mask, Router Replay, routing records); a family
  supplies its layers, each ``forward(x, ctx) -> (x, Routing | None)``.
Attention kinds, routers, experts and mixers live beside these, one file each.
"""
