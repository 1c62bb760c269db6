"""Micro-batches (gradient accumulation by a token budget) and per-layer activation checkpointing.

Micro-batches: ``trainer.micro_batch_tokens`` bounds the tokens one forward holds: a rank's rows,
in order, are cut greedily so that rows x (longest row of the micro-batch) -- or the summed row
lengths when ``pack_sequences`` packs them -- stays within the budget; each micro-batch is cut
to its longest row (trailing columns are padding). Every rank must run the SAME number of
forwards and backwards (each holds collectives: FSDP all-gathers, EP all-to-alls), so the count
is agreed by an all-reduce (max) and a rank with fewer pads with :func:`empty_like` micro-batches:
one pad token, no loss token, no valid token, so they add nothing to the loss or the statistics.

Activation checkpointing (``trainer.activation_checkpointing``): every decoder layer's
``forward`` is replaced on the instance by one that runs it under
``torch.utils.checkpoint.checkpoint`` (non-reentrant: the layer's ``(x, ctx)`` arguments and its
``(x, Routing)`` result pass through as they are). ``full`` keeps only the layer's input and
recomputes everything; ``selective`` keeps the outputs of the matmuls and attention kernels
(:data:`SAVED_OPS`: the expensive FLOPs) and recomputes the cheap elementwise rest (norms,
activations, softmax, routing), which holds most of the activation bytes. Parameter names do not change (no wrapper
module), and FSDP2's hooks, which fire around ``__call__``, still gather a layer's weights
before the forward and before the backward's recompute. Only the saved ops are numbered and
matched between the forward and the recompute (:class:`_SaveOnly`), so the mesh plan's nested
experts FSDP unit, whose hooks run other ops in the two passes, checkpoints selectively too; the
rows its EP all-to-alls delivered are kept (the recompute only re-exchanges the small count
tensor), and so are the expert matmuls.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from workers.trainer.batch import RolloutBatch
from workers.trainer.parallel.dims import ParallelDims


_aten = torch.ops.aten
SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._grouped_mm.default,
             _aten._scaled_dot_product_flash_attention.default,
             _aten._scaled_dot_product_efficient_attention.default,
             _aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops._c10d_functional.all_to_all_single.default}
"""What ``selective`` activation checkpointing keeps: matmul and attention outputs, and the rows the
EP dispatch / combine all-to-alls delivered (workers/trainer/parallel/expert.py), so the recompute
does not move them again."""
try:  # packed rows on CUDA run torch's varlen flash attention (workers/models/blocks/varlen.py)
    import torch.nn.attention.varlen  # noqa: F401  (registers the op)

    SAVED_OPS.add(torch.ops.torch_attn._varlen_attn.default)
except (ImportError, AttributeError):
    pass


def row_lengths(batch: RolloutBatch) -> torch.Tensor:
    """``[B]`` columns each row needs: up to and including its last valid token."""
    valid = batch.attention_mask.bool()
    cols = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    return (valid * cols).amax(1) if valid.shape[1] else valid.new_zeros(valid.shape[0], dtype=torch.long)


def plan_micro_batches(lengths: list[int], budget: int, *, packed: bool) -> list[list[int]]:
    """Row indices of each micro-batch (in order); ``budget`` 0: one micro-batch of every row.
    A row longer than the budget gets a micro-batch of its own (the plan refuses such budgets)."""
    if budget <= 0 or not lengths:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    longest = total = 0
    for i, n in enumerate(lengths):
        cost = (total + n) if packed else (len(groups[-1]) + 1) * max(longest, n)
        if groups[-1] and cost > budget:
            groups.append([])
            longest = total = 0
        groups[-1].append(i)
        longest, total = max(longest, n), total + n
    return groups


def take(batch: RolloutBatch, rows: list[int], lengths: list[int] | None = None) -> RolloutBatch:
    """Rows ``rows`` of ``batch``, cut to the longest of them (at least one column); ``lengths``: every
    row's :func:`row_lengths` already on the host (no sync here)."""
    sub = batch.rows(torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device))
    if lengths is None:
        width = max(1, int(row_lengths(sub).max())) if rows else 1
    else:
        width = max([1] + [lengths[i] for i in rows])
    return cut_columns(sub, width)


def cut_columns(batch: RolloutBatch, width: int) -> RolloutBatch:
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        per_token = isinstance(v, torch.Tensor) and v.dim() >= 2 and f.name != "rewards"
        fields[f.name] = v[:, :width] if per_token else v
    return RolloutBatch(**fields)


def empty_like(batch: RolloutBatch) -> RolloutBatch:
    """A one-row, one-column micro-batch with nothing valid: the padding micro-batch."""
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            shape = (1,) + ((1,) + tuple(v.shape[2:]) if v.dim() >= 2 else ())
            fields[f.name] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        else:
            fields[f.name] = v
    return RolloutBatch(**fields)


def split_micro_batches(shard: RolloutBatch, budget: int, *, packed: bool, dims: ParallelDims) -> list[RolloutBatch]:
    """This rank's micro-batches, as many as the rank that needs the most (COLLECTIVE over ``batch``
    when ``budget`` > 0: one all-reduce of the count)."""
    if budget <= 0:
        return [shard]
    lengths = row_lengths(shard).tolist()  # one host copy for every micro-batch
    groups = plan_micro_batches(lengths, budget, packed=packed)
    count = dims.all_reduce(torch.tensor([len(groups)], dtype=torch.int64, device=dims.device), op="max")
    micro = [take(shard, g, lengths) for g in groups]
    return micro + [empty_like(shard)] * (int(count[0]) - len(micro))


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str) -> None:
    """``mode`` ``full``: recompute each layer in the backward (see the module docstring); ``none``: no-op."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"trainer.activation_checkpointing={mode!r}: choose none | full | selective")
    context = None if mode == "full" else _selective_contexts
    for layer in layers:
        inner = layer.forward  # the bound method of the class: what __call__ would have run
        layer.forward = functools.partial(_checkpointed, inner, context)


def _keep(out):
    """``out`` detached, with the version of each tensor: an in-place change after the forward
    would make the kept value wrong for the backward, so :class:`_ReplaySaved` checks it."""
    kept = tree_map(lambda x: _detach(x) if isinstance(x, torch.Tensor) else x, out)
    return kept, [t._version for t in tree_leaves(kept) if isinstance(t, torch.Tensor)]


def checkpoint_mode(layer: nn.Module) -> str:
    """``none`` | ``full`` | ``selective``: what :func:`apply_activation_checkpointing` did to ``layer``."""
    fwd = layer.__dict__.get("forward")
    fwd = getattr(fwd, "inner", fwd)  # under trainer.compile: the compiled wrapper's uncompiled forward
    if not (isinstance(fwd, functools.partial) and fwd.func is _checkpointed):
        return "none"
    return "full" if fwd.args[1] is None else "selective"


def _detach(x: torch.Tensor) -> torch.Tensor:
    # Below autograd (inside a dispatch mode) the ADInplaceOrView key is excluded and a plain detach
    # would get its own version counter; re-enabled, it shares the original's (what torch's SAC does).
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


class _SaveOnly(TorchDispatchMode):
    """The forward side of ``selective``: keeps the outputs of the :data:`SAVED_OPS`, in call order.

    Our own pair of modes, not torch's ``create_selective_checkpoint_contexts``: torch's number
    EVERY op of the region and the recompute must replay the same numbers, but under the mesh plan
    a MoE layer holds the experts' own FSDP unit, whose hooks run other bookkeeping ops
    (record_function, copies, collectives) in the backward's recompute than in the forward (its
    parameters are already gathered for the backward). Ops that are recomputed anyway need no
    number: only the saved ops (matmuls, attention, row all-to-alls: the same ones in the same
    order in both passes) are queued and matched. torch's mode classes are private and changed
    between 2.11 and 2.13, so they are not subclassed.
    """

    def __init__(self, store: dict):
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            self.store[func].append(_keep(out))
        return out


class _ReplaySaved(TorchDispatchMode):
    """The recompute side of :class:`_SaveOnly`: saved ops come from its queues, the rest run."""

    def __init__(self, store: dict):
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        queue = self.store.get(func)
        if not queue:
            raise RuntimeError(f"selective activation checkpointing: {func} ran more often in the recompute than in "
                               f"the forward (the layer's forward must run the same matmuls both times)")
        kept, versions = queue.popleft()
        if versions != [t._version for t in tree_leaves(kept) if isinstance(t, torch.Tensor)]:
            raise RuntimeError(f"selective activation checkpointing: the output of {func} kept in the forward was "
                               f"changed in place afterwards; add the changing op to the model out of place")
        return kept


def _selective_contexts():
    store = collections.defaultdict(collections.deque)
    return _SaveOnly(store), _ReplaySaved(store)


def _checkpointed(forward, context, *args, **kwargs):
    if not torch.is_grad_enabled():  # inference / no-grad passes: nothing to save
        return forward(*args, **kwargs)
    # The skeleton reuses ONE ForwardContext for every layer (ctx.layer, ctx.forced change per
    # layer): the recompute must see this layer's values, so it gets a shallow copy taken now
    # (its cache stays shared). Its memo too is the forward's as of now (a shallow dict copy): the
    # recompute then runs exactly the forward's ops (layer 0 computes the rotary tables again; a DSA
    # layer reads the indexer mask of the layer before it, not the last one) -- and under
    # trainer.compile the same compiled graph, which saves the same tensors.
    # What this layer's forward adds to its copy of the memo (a DSA 'full' layer's indexer mask) goes
    # back into the shared one afterwards, so the next layer's forward reads it.
    originals = args
    args = tuple(_snapshot(a) if dataclasses.is_dataclass(a) and not isinstance(a, type) else a for a in args)
    if context is not None:
        out = checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
    else:
        out = checkpoint(forward, *args, use_reentrant=False, **kwargs)
    for original, snap in zip(originals, args):
        if snap is not original and isinstance(getattr(snap, "memo", None), dict):
            original.memo.update(snap.memo)
    return out


def _snapshot(ctx):
    ctx = copy.copy(ctx)
    if isinstance(getattr(ctx, "memo", None), dict):
        ctx.memo = dict(ctx.memo)
    return ctx
