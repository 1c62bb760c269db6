"""Per-GPU activation memory of one trainer forward + backward of the longest sequence (plan time).

Why: parameters, gradients and AdamW state are the fixed part of a trainer GPU's memory
(launcher/estimate.py ``trainer_memory``); a 131,072-token agentic episode adds activations that
grow with the sequence and can exceed the rest. The plan prints this number and refuses a layout
whose states + activations pass :data:`FIT_FRACTION` of a GPU, before anything is submitted.

What one forward holds, per token, in the compute dtype (``trainer.dtype``), from the model's
architecture facts (workers/models/facts.py), counted the way the trainer runs it
(workers/trainer/step.py, micro.py, workers/models/blocks/):

* per decoder layer, what autograd keeps (:func:`layer_bytes`): the norms' outputs, the q/k/v
  (or MLA latent, expanded keys/values) projections, the rotated q/k, the attention output and its
  log-sum-exp, the router's float32 logits and probabilities, and for each expert a token visits
  (top_k routed + shared) its gathered input, gate, up, activation and product, and down output
  (routed: ``ep_capacity_factor`` x as many rows under the fixed-capacity EP dispatch, padding included);
  attention is per document with a flash kernel, so nothing here is T x T;
* ``activation_checkpointing``: ``none`` keeps every layer's; ``full`` keeps each layer's input
  and recomputes one layer at a time in the backward; ``selective`` keeps the matmul and attention
  outputs of every layer (at ep > 1 also the rows its EP all-to-alls delivered) and recomputes the rest one layer at a time (measured on CPU: the layer
  being recomputed, with its gradients, peaks at about one layer's activations);
* the trainer around the model: rotary tables, routing records (forced, chosen, own top-k as
  int64; the router probabilities are reduced to [E] sums as each router runs), packing indices and the loss's per-token tensors (:data:`TRAINER_BYTES_PER_TOKEN` plus
  the routing terms), the embedding output and the final hidden states with their gradients;
* the head: ``trainer.logprob_chunk_tokens`` x vocabulary float32 logits, about
  :data:`HEAD_COPIES` alive at once (logits, scaled copy, exp, gradient), vocabulary / tp each,
  under ``trainer.logprob_head=checkpoint`` (and at tp > 1); the fused heads hold
  :data:`FUSED_HEAD_BYTES` per logit plus the compute-dtype GEMM output when that is not float32
  (its CUDA kernels need only the latter: an over-estimate there); ``fused_loss`` adds
  the head weight's float32 gradient, 4 x vocabulary x hidden bytes, held from the head's forward
  to its backward;
  it is alive when no layer is being recomputed, so the peak is what stays plus the larger of the
  two.

Tokens per GPU (:func:`forward_tokens`): a micro-batch of ``trainer.micro_batch_tokens`` (at least
the longest sample: ``env.max_episode_tokens`` when the env has one, else
``model.max_position_embeddings``), or with micro_batch_tokens 0 the rank's whole batch of rows at
the longest sample's length, divided by ``trainer.parallel.cp`` (context parallel: each rank holds 1/cp of the sequence,
under the FSDP plan or with tp/ep in the mesh plan). Attention/MLP widths divide by tp; under cp attention
holds all T positions for 1/(tp*cp) of the heads, the same bytes as T/cp positions of 1/tp of them. A hybrid family's Mamba-2 layers are counted
as its attention layers (an over-estimate: a Mamba layer keeps no per-head attention output). tests/unit/launcher/test_activation_estimate.py holds
the estimate to within 25% of the measured peak of a real trainer step on CPU.
Pure arithmetic; no torch (the launcher imports it on the login node).
"""
from __future__ import annotations

import dataclasses

from workers.models.spec import DSA_CHUNK_PAIRS
from workers.models.spec import architecture

FIT_FRACTION = 0.9
"""Share of a GPU that trainer states + activations may plan to use (the rest: allocator
fragmentation, NCCL buffers, the CUDA context)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINER_BYTES_PER_TOKEN = 160
"""int64 ids, positions, segment ids and packing indices (~8 x 8 B), float32/float64 per-token loss
tensors (log-probs, entropy, ratios, masks, advantages: ~12 x 8 B)."""
INDEXER_BYTES_PER_PAIR = 4
"""float32 relu score of one (query, key) pair for one DSA index head."""
DSA_INDEX_BYTES = 4
"""int32 position of one chosen key of one query (the memory-linear DSA path keeps [T, topk] per layer)."""
DSA_SCORE_COPIES = 4
"""float32 [heads, chunk, topk] tensors alive at once in a sparse-attention chunk (scores, masked,
probabilities, and a gradient in the backward)."""
HEAD_COPIES = 4
FUSED_HEAD_BYTES = 8
"""Bytes per logit of the fused head's torch path (workers/models/blocks/fused_logprobs.py): two
float32 blocks (logits / T and their exp, or in the backward the softmax and its gradient)."""
"""float32 [chunk, V] tensors alive at once while a log-prob chunk is scored or recomputed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    tokens: int
    """Tokens one GPU holds in one forward (longest sequence or micro-batch, / cp)."""
    total_bytes: int
    layers_bytes: int
    head_bytes: int
    trainer_bytes: int
    indexer_bytes: int
    detail: str


def layer_bytes(a, *, tp: int, c: int, routed_rows: float = 1.0) -> tuple[float, float]:
    """(bytes a decoder layer keeps per token with no checkpointing, of which matmul/attention outputs).
    ``routed_rows``: expert rows per routed slot (:func:`dispatch_rows`)."""
    h = a.hidden_size
    heads = max(1, a.num_heads // tp)
    if a.attention == "mla":
        qk, dv = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
        mm = a.q_lora_rank + heads * qk + a.kv_lora_rank + a.qk_rope_head_dim + heads * (a.qk_nope_head_dim + dv) + h
        other = a.q_lora_rank + a.kv_lora_rank + 2 * heads * qk + heads * qk  # normed latents, rotated q/k, padded v
        attn_out = heads * dv  # (the DSA indexer runs under no_grad: it keeps nothing)
    else:
        d = a.mha_head_dim
        kv = max(1, (a.num_kv_heads or a.num_heads) // tp)
        mm = heads * d + 2 * kv * d + h
        other = heads * d + kv * d + (2 * heads * d if kv < heads else 0)  # rotated q/k, repeated k/v
        attn_out = heads * d
    mm_bytes = (mm + attn_out) * c + heads * 4  # + the attention's float32 log-sum-exp
    other_bytes = (other + 2 * h) * c + 2 * h * 4  # + the two norms' outputs and their float32 rstd/inputs
    if a.is_moe:
        inter = a.expert_intermediate_size // tp
        visits = a.top_k * routed_rows + a.num_shared_experts
        e = a.num_experts
        mm_bytes += e * 4 + visits * (2 * inter + h) * c  # router logits, gate/up/down outputs
        other_bytes += 2 * e * 4 + visits * (h + 2 * inter) * c + a.top_k * 8 * 3  # probs, inputs, act, indices
    else:
        inter = a.dense_intermediate_size // tp
        mm_bytes += (2 * inter + h) * c
        other_bytes += 2 * inter * c
    return mm_bytes + other_bytes, mm_bytes


def dispatch_rows(ep: int, ep_capacity_factor: float) -> float:
    """Expert rows per routed slot: the fixed-capacity EP dispatch (workers/trainer/parallel/expert_capacity.py) runs
    the experts over buffers of ``factor`` x the slots (padding included); exact dispatch: 1."""
    return max(1.0, ep_capacity_factor) if ep > 1 and ep_capacity_factor > 0 else 1.0


def activation_memory(model_cfg, *, tokens: int, ac: str, tp: int = 1, cp: int = 1, compute_dtype: str = "bfloat16",
                      logprob_chunk: int = 4096, routed_rows: float = 1.0, ep: int = 1,
                      logprob_head: str = "fused_loss") -> ActivationEstimate:
    """Peak activation bytes on one trainer GPU for ``tokens`` tokens of one forward (before / cp).

    A DSA model (``num_indexer_heads``) adds its indexer and sparse attention (:func:`dsa_bytes`)."""
    a = architecture(model_cfg)
    c = DTYPE_BYTES[compute_dtype]
    n = -(-tokens // cp)
    per_layer, saved_mm = layer_bytes(a, tp=tp, c=c, routed_rows=routed_rows)
    # At ep > 1 selective also keeps the rows each MoE layer's all-to-alls delivered, there and back
    # (workers/trainer/micro.py SAVED_OPS); autograd itself keeps none of them.
    exchanged = 2 * a.top_k * routed_rows * a.hidden_size * c * a.num_moe_layers if ep > 1 and a.is_moe else 0.0
    num_layers, inputs = a.num_layers, a.num_layers * a.hidden_size * c
    if ac == "none":  # everything kept; the backward frees layer by layer from the top
        kept, working = num_layers * per_layer, 0.0
    elif ac == "selective":  # matmul/attention outputs kept; one layer's rest recomputed at a time
        kept, working = num_layers * saved_mm + exchanged + inputs, per_layer - saved_mm
    elif ac == "full":  # layer inputs kept; one layer recomputed at a time
        kept, working = inputs, per_layer
    else:
        raise ValueError(f"trainer.activation_checkpointing={ac!r}: choose none | full | selective")
    routed_layers = a.num_moe_layers
    trainer = int(n * (TRAINER_BYTES_PER_TOKEN + routed_layers * a.top_k * 8 * 4
                       + 4 * a.hidden_size * c + 4 * a.mha_head_dim * c))
    chunk = min(n, logprob_chunk) if logprob_chunk > 0 else n
    fused = logprob_head in ("fused", "fused_loss") and tp == 1
    per_logit = (FUSED_HEAD_BYTES + (c if c != 4 else 0)) if fused else HEAD_COPIES * 4
    head = int(per_logit * chunk * -(-a.vocab_size // tp))
    if logprob_head == "fused_loss" and tp == 1:  # the head weight's float32 gradient, forward to backward
        head += 4 * a.vocab_size * a.hidden_size
    # The head's chunk (scored after the last layer, recomputed first in the backward) and the layer being
    # recomputed are never alive together: the peak is the larger of the two over what stays.
    layers = int(n * (kept + working))
    indexer = dsa_bytes(a, n=n, keys=tokens, c=c, tp=tp, cp=cp)
    if indexer and getattr(a, "dsa_chunk_tokens", 0):  # the chosen positions of every layer are saved for backward
        kept_layers = num_layers if ac != "full" else 1
        indexer += int(kept_layers * n * min(a.index_topk, tokens) * DSA_INDEX_BYTES)
    total = int(n * kept) + max(head, int(n * working) + indexer) + trainer
    detail = (f"{human_bytes(total)} for {n} tokens/GPU ({tokens} per forward / cp {cp}), activation_checkpointing "
              f"{ac}: layers {human_bytes(layers)}, log-prob head {human_bytes(head)} (chunk {chunk}), "
              f"trainer tensors {human_bytes(trainer)}"
              + (f", DSA indexer {human_bytes(indexer)} ({dsa_how(a, cp)})" if indexer else ""))
    return ActivationEstimate(tokens=n, total_bytes=total, layers_bytes=layers, head_bytes=head, trainer_bytes=trainer,
                              indexer_bytes=indexer, detail=detail)


def dsa_bytes(a, *, n: int, keys: int, c: int, tp: int, cp: int = 1) -> int:
    """Working bytes of one DSA layer for ``n`` queries over ``keys`` keys (0 without an indexer).

    Memory-linear path (``dsa_chunk_tokens`` C > 0, workers/models/blocks/dsa_sparse.py), one chunk of
    C queries at a time: the indexer's float32 scores against every key (per index head, relu'd,
    weighted, masked: :data:`INDEXER_BYTES_PER_PAIR` each, plus the visibility rows) and the
    attention's gathered latents ``C x topk x (kv_lora_rank + qk_rope_head_dim)`` with their gradient,
    and its float32 scores, probabilities and their gradients per local head
    (:data:`DSA_SCORE_COPIES`); plus, under cp, the whole sequence's gathered latents. The chosen
    positions (int32 ``[n, topk]`` per layer) are added by the caller. Dense reference path (C = 0):
    at cp 1 every (query, key) pair at once, quadratic; under cp (workers/models/blocks/dsa_cp.py)
    :data:`DSA_CHUNK_PAIRS` pairs scored at a time (float32 per index head, plus the index,
    visibility and top-k work), the gathered chosen indices of every query and this rank's (int64
    ``[T + n, index_topk]``), an attention chunk's mask rows (bools and their float bias)."""
    if not a.num_indexer_heads:
        return 0
    chunk = getattr(a, "dsa_chunk_tokens", 0)
    if not chunk and cp == 1:
        return n * keys * (a.num_indexer_heads * INDEXER_BYTES_PER_PAIR + 7)
    if not chunk:
        pairs = min(n, max(1, DSA_CHUNK_PAIRS // keys)) * keys
        return pairs * (a.num_indexer_heads * INDEXER_BYTES_PER_PAIR + 13) + (keys + n) * a.index_topk * 8 + pairs * 7
    c_q, k = min(chunk, n), min(a.index_topk, keys)
    latent = a.kv_lora_rank + a.qk_rope_head_dim
    heads = max(1, a.num_heads // tp)
    scoring = c_q * keys * (2 * a.num_indexer_heads * INDEXER_BYTES_PER_PAIR + 9)
    attention = c_q * k * (2 * latent * c + DSA_SCORE_COPIES * heads * 4)
    gathered = 2 * keys * latent * c if keys > n else 0  # cp: every rank's latents, and their gradient
    return int(scoring + attention + gathered)


def dsa_how(a, cp: int = 1) -> str:
    chunk = getattr(a, "dsa_chunk_tokens", 0)
    if chunk:
        return f"query chunks of {chunk}, top {a.index_topk} keys each"
    return "dense reference path: every (query, key) pair" if cp == 1 else f"dense path in chunks of {DSA_CHUNK_PAIRS} pairs"


def longest_sample(cfg) -> tuple[int, str]:
    """(tokens of the longest sample a run can produce, the key that bounds it): a multi-turn env's
    ``env.max_episode_tokens`` (the runner enforces it), else ``model.max_position_embeddings``."""
    episode = getattr(cfg.env, "max_episode_tokens", None)
    if isinstance(episode, int) and 0 < episode < cfg.model.max_position_embeddings:
        return episode, "env.max_episode_tokens"
    return cfg.model.max_position_embeddings, "model.max_position_embeddings"


def forward_tokens(cfg, rows_per_rank: int) -> int:
    """Tokens of the largest forward a trainer rank runs: a micro-batch of ``trainer.micro_batch_tokens``
    (at least one whole sample), or with 0 the rank's whole batch at once, every row as long as the
    longest sample can be (rows are padded to the longest; packing holds at most as much)."""
    longest, _ = longest_sample(cfg)
    mbt = cfg.trainer.micro_batch_tokens
    return max(mbt, longest) if mbt > 0 else max(1, rows_per_rank) * longest


def human_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def trainer_fit(cfg, states_gb: float, gpu_gb: float, *, num_ranks: int, rows_per_rank: int,
                states_how: str = "") -> tuple[float, str, int]:
    """(states + activations in GB per trainer GPU, the plan's line, the smallest cp that fits or 0).

    ``states_gb``: launcher/estimate.py ``trainer_memory`` (parameters, gradients, AdamW state, sharded
    over the trainer GPUs as the trainer shards them). Fits when the sum is <= FIT_FRACTION x gpu_gb.
    ``rows_per_rank``: samples of a step each rank trains on (its forward with micro_batch_tokens 0).
    """
    t = cfg.trainer
    cp = t.parallel.cp
    tokens = forward_tokens(cfg, rows_per_rank)

    def act(c: int) -> ActivationEstimate:
        head = getattr(t, "logprob_head", "fused_loss")
        if head == "fused_loss" and not (t.ratio_level == "token" and t.entropy_coef == 0 and c == 1):
            head = "fused"  # the step falls back to the two-pass head (workers/trainer/head_loss.py applies)
        return activation_memory(cfg.model, tokens=tokens, ac=t.activation_checkpointing, tp=t.parallel.tp,
                                 cp=c, compute_dtype=t.dtype, logprob_chunk=t.logprob_chunk_tokens,
                                 routed_rows=dispatch_rows(t.parallel.ep, t.parallel.ep_capacity_factor),
                                 ep=t.parallel.ep, logprob_head=head)

    usable = FIT_FRACTION * gpu_gb
    a = act(cp)
    total = states_gb + a.total_bytes / 1e9
    need = next((c for c in (1, 2, 4, 8, 16, 32, 64) if c <= num_ranks and states_gb + act(c).total_bytes / 1e9 <= usable), 0)
    how = f" ({states_how})" if states_how else ""
    line = (f"states {states_gb:.1f} GB{how} + activations {a.detail} = {total:.1f} GB/GPU of {usable:.1f} "
            f"({FIT_FRACTION:.0%} of {gpu_gb:.0f})")
    return total, line, need
