"""Sequence packing: many samples per micro-batch up to a token budget, no attention across them.

Why: agentic samples range from a few hundred to 131k tokens. Right-padding a batch to
its longest row wastes most of the compute; packing concatenates rows into one stream
per micro-batch and tells attention where each sample starts, so the math per sample is
exactly that of the unpacked row (tests/unit/trainer/test_packing.py and test_packing_families.py check
it against the real models; tests/integration/test_parity_parallel.py checks a packed training
step). The model turns ``segment_ids`` into per-sample attention and state resets without a
[T, T] mask (workers/models/blocks/varlen.py), so a 131k-token row costs O(T) memory.

Pure functions of tensors: no process group, no I/O, no model. Two layouts:

* rows — ``plan_packing(attention_mask)`` -> :class:`RowPacking`: the [B, T] rows packed into
  fewer rows [P, L] (first-fit decreasing, L = T). This is what the trainer's forward uses
  with ``trainer.pack_sequences=true`` (workers/trainer/step.py)::

      p = plan_packing(batch.attention_mask)
      need = p.pack(loss_relevant_inputs(batch.loss_mask), False)  # logits only where they are scored
      out = model(p.pack(ids), position_ids=p.position_ids, attention_mask=p.attention_mask,
                  segment_ids=p.segment_ids,                       # attention per sample, no [T, T] mask
                  forced_experts=p.pack(forced), forced_mask=p.pack(forced_mask, False), logits_mask=need)
      logp = p.unpack_shifted(scatter_logprobs(model, out.logits, p.pack(ids), need, temperature))  # [B, T]
      routed = p.unpack(out.routed_experts)                        # loss and metrics stay in row layout

* stream — ``pack_batch(fields, attention_mask, token_budget=N)`` -> list of
  :class:`PackedBatch`: micro-batches of one [1, N] stream each, for a token budget per
  micro-batch (long agentic samples: 131072 tokens is one sample per micro-batch) and for
  varlen kernels::

      for mb in pack_batch(fields, batch.attention_mask, token_budget=131072, expand_rows=("advantages",)):
          x = mb.tensors                                           # each field [1, N, ...]
          out = model(x["input_ids"], position_ids=mb.position_ids, attention_mask=mb.valid,
                      segment_ids=mb.seq_ids)                      # or flash-attn varlen: mb.cu_seqlens, mb.max_seqlen
          logp = token_logprobs(out.logits, x["input_ids"], temperature)   # [1, N]
          loss = policy_loss(logp, x["inference_logprobs"], x["advantages"], x["loss_mask"], ...)

  ``fields`` are [B, T, ...] per-token tensors or [B] per-row ones (``expand_rows`` broadcasts
  those to their tokens). ``mb.attention_mask()`` is the dense [1, 1, N, N] block-causal mask
  for plain SDPA (O(N^2): small budgets only); ``mb.unpack`` maps values back to [B, T].

Rules for both: token t is scored from the logits at t-1, which at a sample's first token
belong to the previous sample; ``unpack_shifted`` zeroes those, ``PackedBatch.first_token``
marks them and ``pack_rows`` refuses a loss_mask set there (the protocol keeps
loss_mask[:, 0] = 0). Normalisers (num_loss_tokens, expert counts) stay global over the
step: packing changes which rows share a forward, not what the loss sums.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Sequence

import torch


class PackingError(ValueError):
    """A sample cannot be packed (longer than the budget, or a loss token at a boundary)."""


def plan_micro_batches(lengths: Sequence[int], *, token_budget: int, max_rows: Optional[int] = None) -> list[list[int]]:
    """First-fit-decreasing bins of row indices whose lengths sum to <= ``token_budget``.

    Deterministic (ties keep row order), rows inside a bin in ascending order. Longest
    first keeps the number of micro-batches near the minimum (FFD is within 11/9 of it).
    """
    if token_budget <= 0:
        raise PackingError(f"token_budget must be > 0, got {token_budget}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i, n = too_long[0]
        raise PackingError(f"row {i} has {n} tokens > token_budget({token_budget}); raise the budget or cut the "
                           f"episode (env.max_episode_tokens)")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if lengths[i] == 0:
            continue
        for b, free in enumerate(room):
            if lengths[i] <= free and (max_rows is None or len(bins[b]) < max_rows):
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    return [sorted(b) for b in bins]


@dataclasses.dataclass
class PackedBatch:
    rows: list[int]
    """Original batch row of each packed sample, in stream order."""
    cu_seqlens: torch.Tensor
    """int32 [S + 1]: sample s occupies stream positions cu_seqlens[s] .. cu_seqlens[s+1]-1."""
    max_seqlen: int
    position_ids: torch.Tensor
    """int64 [1, N]: position inside its own sample (0 at every start; 0 on padding)."""
    seq_ids: torch.Tensor
    """int64 [1, N]: packed sample index of each position, -1 on padding."""
    tensors: dict[str, torch.Tensor]
    """Per-token fields packed to [1, N, ...]; per-row fields (not expanded) as [S]."""

    @property
    def num_tokens(self) -> int:
        return int(self.seq_ids.shape[1])

    @property
    def valid(self) -> torch.Tensor:
        """bool [1, N]: real tokens (False on padding)."""
        return self.seq_ids >= 0

    @property
    def first_token(self) -> torch.Tensor:
        """bool [1, N]: the first token of each sample (its 'previous logit' is another sample's)."""
        first = torch.zeros_like(self.valid)
        first[0, self.cu_seqlens[:-1].long()] = True
        return first

    def attention_mask(self) -> torch.Tensor:
        """bool [1, 1, N, N] for scaled_dot_product_attention: same sample and causal.

        Padding positions attend to themselves only (a fully masked row would give NaN)."""
        s = self.seq_ids[0]
        same = (s[:, None] == s[None, :]) & (s[:, None] >= 0)
        causal = torch.ones(len(s), len(s), dtype=torch.bool, device=s.device).tril()
        mask = (same & causal) | torch.eye(len(s), dtype=torch.bool, device=s.device)
        return mask[None, None]

    def unpack(self, packed: torch.Tensor, *, num_rows: int, seq_len: int) -> torch.Tensor:
        """[1, N, ...] stream values back to right-padded [num_rows, seq_len, ...] (zeros elsewhere;
        rows of the batch that are not in this micro-batch stay zero)."""
        out = packed.new_zeros((num_rows, seq_len, *packed.shape[2:]))
        for s, row in enumerate(self.rows):
            a, b = int(self.cu_seqlens[s]), int(self.cu_seqlens[s + 1])
            out[row, : b - a] = packed[0, a:b]
        return out


def pack_rows(fields: Mapping[str, torch.Tensor], lengths: Sequence[int], rows: Sequence[int], *,
              pad_to: Optional[int] = None, expand_rows: Iterable[str] = ()) -> PackedBatch:
    """Concatenate the first ``lengths[r]`` tokens of each row in ``rows`` (right-padded input).

    ``fields`` maps names to [B, T, ...] per-token tensors or [B] per-row tensors; per-row
    names in ``expand_rows`` are broadcast to every token of their sample (e.g. sequence
    advantages), other per-row fields are gathered to [S]. ``pad_to`` pads the stream to a
    fixed N (static shapes); padding gets seq_id -1, position 0 and zeros in every field.
    """
    expand = set(expand_rows)
    lens = [int(lengths[r]) for r in rows]
    total = sum(lens)
    n = total if pad_to is None else pad_to
    if n < total:
        raise PackingError(f"pad_to({pad_to}) < {total} tokens of rows {list(rows)}")
    device = next(iter(fields.values())).device if fields else torch.device("cpu")
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    seq_ids = torch.full((1, n), -1, dtype=torch.int64, device=device)
    position_ids = torch.zeros((1, n), dtype=torch.int64, device=device)
    for s, length in enumerate(lens):
        a = int(cu[s])
        seq_ids[0, a:a + length] = s
        position_ids[0, a:a + length] = torch.arange(length, device=device)
    index = torch.tensor(list(rows), dtype=torch.int64, device=device)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in fields.items():
        if t.dim() == 1 and name not in expand:
            tensors[name] = t.index_select(0, index)
            continue
        out = t.new_zeros((1, n, *t.shape[2:])) if t.dim() > 1 else t.new_zeros((1, n))
        for s, (row, length) in enumerate(zip(rows, lens)):
            a = int(cu[s])
            out[0, a:a + length] = t[row] if t.dim() == 1 else t[row, :length]
        tensors[name] = out
    packed = PackedBatch(rows=list(rows), cu_seqlens=cu.to(device), max_seqlen=max(lens, default=0),
                         position_ids=position_ids, seq_ids=seq_ids, tensors=tensors)
    if "loss_mask" in tensors and bool((tensors["loss_mask"].bool() & packed.first_token).any()):
        raise PackingError("loss_mask is set on the first token of a sample; it has no logit of its own "
                           "(protocol: loss_mask[:, 0] == 0)")
    return packed


def pack_batch(fields: Mapping[str, torch.Tensor], attention_mask: torch.Tensor, *, token_budget: int,
               pad_to_budget: bool = False, max_rows: Optional[int] = None,
               expand_rows: Iterable[str] = ()) -> list[PackedBatch]:
    """Split a right-padded batch into packed micro-batches of <= ``token_budget`` tokens each."""
    lengths = attention_mask.sum(dim=1).tolist()
    plan = plan_micro_batches(lengths, token_budget=token_budget, max_rows=max_rows)
    return [pack_rows(fields, lengths, rows, pad_to=token_budget if pad_to_budget else None,
                      expand_rows=expand_rows) for rows in plan]


class RowPacking:
    """Rows of a right-padded [B, T] batch packed into fewer rows [P, L] (L = T by default).

    The layout step.py's forward uses (``trainer.pack_sequences``): the model keeps its
    batched [P, L] shape and gets ``segment_ids`` (block-diagonal attention) and per-segment
    ``position_ids``; ``pack`` / ``unpack`` move any per-token tensor between the layouts by
    index (autograd flows through both), ``unpack_shifted`` also zeroes column 0 of every
    row, whose packed log-prob was predicted from the previous segment's last token.
    """

    def __init__(self, attention_mask: torch.Tensor, *, row_len: Optional[int] = None):
        valid = attention_mask.bool()
        b, t = valid.shape
        self.num_rows, self.seq_len = b, t
        lengths = valid.sum(dim=1).tolist()
        if any(bool(valid[i, n:].any()) for i, n in enumerate(lengths)):
            raise PackingError("plan_packing needs right-padded rows (protocol.py: valid tokens first)")
        width = row_len or t
        bins = plan_micro_batches(lengths, token_budget=width) or [[]]
        dev = attention_mask.device
        p = len(bins)
        self.src_row = torch.zeros(p, width, dtype=torch.long, device=dev)
        self.src_pos = torch.zeros(p, width, dtype=torch.long, device=dev)
        self.segment_ids = torch.full((p, width), -1, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros(p, width, dtype=torch.long, device=dev)
        self.dst_bin = torch.zeros(b, t, dtype=torch.long, device=dev)
        self.dst_pos = torch.zeros(b, t, dtype=torch.long, device=dev)
        for k, rows in enumerate(bins):
            offset = 0
            for s, row in enumerate(rows):
                n = lengths[row]
                span = torch.arange(n, device=dev)
                self.src_row[k, offset:offset + n] = row
                self.src_pos[k, offset:offset + n] = span
                self.segment_ids[k, offset:offset + n] = s
                self.position_ids[k, offset:offset + n] = span
                self.dst_bin[row, :n] = k
                self.dst_pos[row, :n] = offset + span
                offset += n
        self.attention_mask = self.segment_ids >= 0
        self.row_valid = valid

    def pack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """[B, T, ...] -> [P, L, ...]; padding positions get ``fill``."""
        out = x[self.src_row, self.src_pos]
        pad = ~self.attention_mask
        return out.masked_fill(pad.view(*pad.shape, *([1] * (out.dim() - 2))), fill) if bool(pad.any()) else out

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[P, L, ...] -> [B, T, ...]; positions past a row's length are zero."""
        out = y[self.dst_bin, self.dst_pos]
        pad = ~self.row_valid
        return out.masked_fill(pad.view(*pad.shape, *([1] * (out.dim() - 2))), 0) if bool(pad.any()) else out

    def unpack_shifted(self, y: torch.Tensor) -> torch.Tensor:
        """``unpack`` for next-token quantities (log-probs, entropies): column 0 of each row is 0."""
        out = self.unpack(y)
        return torch.cat([out.new_zeros(out.shape[0], 1, *out.shape[2:]), out[:, 1:]], dim=1)


def plan_packing(attention_mask: torch.Tensor, *, row_len: Optional[int] = None) -> RowPacking:
    """Pack the rows of a right-padded batch into as few rows of ``row_len`` (default T) as FFD finds."""
    return RowPacking(attention_mask, row_len=row_len)
