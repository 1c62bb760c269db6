"""Trainer side of sparse deltas: which published elements changed since the last version, on the device.

Per source tensor this rank holds (a parameter's local shard, an expert stack, a buffer) the tracker
keeps a snapshot of its last published values in the published dtype (2 bytes per element for bf16:
1/8 of what fp32 master weights plus AdamW moments already take), on the device or, with
``weights.delta_snapshot=host``, in pinned host memory. After an optimizer step, :meth:`diff` casts the
shard to the published dtype, compares bit patterns with the snapshot (exact: nothing that a dense
publish would change is missed, NaN payloads included), takes the changed positions and values and
writes them into the snapshot. Positions are mapped from the local shard to the full tensor (DTensor
placements through torch's own ``compute_local_shape_and_global_offset``, the box DCP uses; expert
stacks shifted by their first global expert) and then into each published HF tensor (an expert stack
is E x 2-3 HF tensors, each a contiguous flat range of the full stack). Shards held by several ranks
(replicas) are sent by the lowest of them only, decided once from every rank's boxes.

Digests: every HF tensor's sum64 (sum64.py) is kept as this rank's partial sum over its boxes and
updated from old and new values at the changed positions only; rank 0 adds the ranks' changes up.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from workers.weights.base import Peers, TensorMeta
from workers.weights.delta.patch import Part
from workers.weights.delta.sum64 import CHUNK, MASK, bits, segment_sums_device
from workers.common.dtensor import local_part
from workers.weights.stream import DictStream

_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass
class Source:
    """One tensor this rank holds a box of, and the HF tensors its full version splits into."""

    name: str
    tensor: Any
    """The live parameter or buffer (DTensor or plain): read at every diff."""
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    seg_starts: list[int]
    """Flat start of each HF tensor inside the full source (sorted), with its name and element count."""
    seg_names: list[str]
    seg_numels: list[int]
    dtype: torch.dtype
    """The published dtype."""
    sends: bool = True
    """This rank sends the box's changes (False: a replica of a lower rank's box)."""

    @property
    def key(self) -> tuple:
        return self.name, self.offset, self.local_shape

    def local(self) -> torch.Tensor:
        return local_part(self.tensor.detach())


def _box(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset, local shape) of this rank's part of ``t``."""
    if hasattr(t, "device_mesh") and hasattr(t, "placements"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(t.shape), tuple(offset), tuple(shape)
    return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)


def sources_of(weights: DictStream, metas: list[TensorMeta]) -> list[Source]:
    """The sources of a weight stream: its ``state`` entries, an expert stack split into the
    published experts its ``slots`` name (the trainer's ModelWeights), any other tensor its own
    single segment."""
    dtypes = {m.name: m.dtype for m in metas}
    hf_of = {ours: hf for hf, ours in weights.ours.items()}
    stacks = {slot.prefix + slot.stack: slot for slot in weights.slots.values()}
    out = []
    for name, t in weights.state.items():
        gshape, offset, lshape = _box(t)
        if name in stacks:
            mod, pre, stack = stacks[name].module, stacks[name].prefix, stacks[name].stack
            ep = max(1, len({s.owner for s in weights.slots.values() if s.prefix == pre}))
            gshape = (gshape[0] * ep, *gshape[1:])
            offset = (offset[0] + mod.first, *offset[1:])
            full = torch.empty(gshape, device="meta")
            segs = [(v.storage_offset(), hf_of[pre + n], v.numel()) for n, v in mod.split_stack(stack, full, 0)]
        elif name in hf_of:
            segs = [(0, hf_of[name], t.numel())]
        else:
            continue  # not published (a buffer the stream leaves out)
        segs.sort()
        dtype = getattr(torch, dtypes[segs[0][1]])
        out.append(Source(name, t, gshape, offset, lshape, [s[0] for s in segs], [s[1] for s in segs],
                          [s[2] for s in segs], dtype))
    covered = {n for s in out for n in s.seg_names}
    missing = [m.name for m in metas if m.name not in covered]
    assert not missing, f"published tensors with no source: {missing[:3]}"
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat positions of ``mask``'s True elements, ``count`` of them known already: ``nonzero_static``
    needs no host read to size its output (plain ``nonzero`` where a build lacks it for the device)."""
    try:
        return torch.nonzero_static(mask, size=count).squeeze(1)
    except (NotImplementedError, RuntimeError):
        return torch.nonzero(mask).squeeze(1)


def _to_host(raw: list[tuple[Source, torch.Tensor, torch.Tensor]]) -> list[tuple[Source, torch.Tensor, torch.Tensor]]:
    """``raw`` with positions and values on the host, in two copies for all sources (positions; values
    as bytes, whatever their dtypes), not two per source."""
    if not raw:
        return []
    pos = torch.cat([g for _, g, _ in raw]).cpu()
    blob = torch.cat([v.reshape(-1).view(torch.uint8) for _, _, v in raw]).cpu()
    out, i, b = [], 0, 0
    for s, g, v in raw:
        n, nb = g.numel(), v.numel() * v.element_size()
        part = blob[b:b + nb]
        out.append((s, pos[i:i + n], (part if b % v.element_size() == 0 else part.clone()).view(v.dtype)))
        i, b = i + n, b + nb
    return out


def _to_global(local_idx: torch.Tensor, src: Source) -> torch.Tensor:
    """Flat positions in the full source of flat positions in this rank's box (row-major both:
    the order is kept, so sorted stays sorted)."""
    if src.local_shape == src.global_shape:
        return local_idx
    rem, out, stride = local_idx, torch.zeros_like(local_idx), 1
    for d in reversed(range(len(src.global_shape))):
        coord = rem % src.local_shape[d] + src.offset[d]
        rem = rem // src.local_shape[d]
        out += coord * stride
        stride *= src.global_shape[d]
    return out


class DeltaTracker:
    """This rank's snapshot of the last published values and their per-HF-tensor partial sum64s."""

    def __init__(self, weights, metas: list[TensorMeta], peers: Peers, *, on_host: bool = False):
        self.sources = sources_of(weights, metas)
        self.on_host = on_host
        keys = peers.all_gather_object([s.key for s in self.sources]) if peers.world_size > 1 else [
            [s.key for s in self.sources]]
        first: dict[tuple, int] = {}
        for rank, ks in enumerate(keys):
            for k in ks:
                first.setdefault(k, rank)
        for s in self.sources:
            s.sends = first[s.key] == peers.rank and s.tensor.numel() > 0 and 0 not in s.local_shape
        self.numels = {m.name: 1 for m in metas}
        for s in self.sources:
            self.numels.update(zip(s.seg_names, s.seg_numels))
        self.shapes = {m.name: tuple(m.shape) for m in metas}
        self.snap: dict[str, torch.Tensor] = {}
        self.sums: dict[str, int] = {}

    def rebind(self, weights) -> None:
        """Read the sources from ``weights`` (a fresh stream of the same model: the trainer builds one per
        step), in case a parameter object was replaced."""
        state = getattr(weights, "state", None)
        if state is not None:
            for s in self.sources:
                if s.name in state:
                    s.tensor = state[s.name]

    def reset(self) -> dict[str, int]:
        """Snapshot every sent box as it is now; returns this rank's partial sum64 per HF tensor."""
        self.snap.clear()
        self.sums = {n: 0 for s in self.sources for n in s.seg_names}
        for s in self.sources:
            if not s.sends:
                continue
            flat = s.local().to(s.dtype).reshape(-1)
            snap = flat.clone() if not self.on_host else flat.to("cpu").pin_memory() if flat.is_cuda else flat.clone()
            self.snap[s.name] = snap
            for lo in range(0, flat.numel(), CHUNK):  # one chunk at a time: int64 temporaries stay bounded
                idx = torch.arange(lo, min(lo + CHUNK, flat.numel()), dtype=torch.int64, device=flat.device)
                self._fold_sums([(s, self._seg_terms(s, _to_global(idx, s), bits(flat[lo:lo + CHUNK])))])
        return dict(self.sums)

    @staticmethod
    def _seg_terms(s: Source, g: torch.Tensor, contrib_bits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(HF tensor index within ``s``, position within it, bits) of each element at full-source
        positions ``g``: the terms of a sum64, summed later for many sources at once (device tensors)."""
        if len(s.seg_starts) == 1:
            seg, pos = torch.zeros_like(g), g
        elif len(set(s.seg_numels)) == 1 and s.seg_starts == [k * s.seg_numels[0] for k in range(len(s.seg_starts))]:
            seg = torch.div(g, s.seg_numels[0], rounding_mode="floor")  # equal back-to-back experts: no search
            pos = g - seg * s.seg_numels[0]
        else:
            starts = torch.tensor(s.seg_starts, dtype=torch.int64, device=g.device)
            seg = torch.searchsorted(starts, g, right=True) - 1
            pos = g - starts[seg]
        return seg, pos, contrib_bits

    def _fold_sums(self, pending: list[tuple[Source, tuple[torch.Tensor, ...]]]) -> dict[str, int]:
        """Sum the terms of every entry of ``pending`` per HF tensor (one segment sum over all of them
        on the device, one host read) into ``self.sums``; returns the nonzero changes per HF tensor."""
        if not pending:
            return {}
        segs, base = [], 0
        for s, (seg, _, _) in pending:
            segs.append(seg + base)
            base += len(s.seg_starts)
        got = segment_sums_device(torch.cat([c for _, (_, _, c) in pending]),
                                  torch.cat([p for _, (_, p, _) in pending]), torch.cat(segs), base).tolist()
        changed: dict[str, int] = {}
        i = 0
        for s, _ in pending:
            for n in s.seg_names:
                v = got[i] & MASK
                i += 1
                if v:
                    self.sums[n] = (self.sums[n] + v) & MASK
                    changed[n] = (changed.get(n, 0) + v) & MASK
        return changed

    def _current(self, s: Source) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
        """(the box now, in the published dtype, on the snapshot's device; the snapshot; their int view)."""
        snap = self.snap[s.name]
        new = s.local().to(s.dtype).reshape(-1)
        if snap.device != new.device:
            new = new.to(snap.device, non_blocking=False)
        return new, snap, _INT_OF[new.element_size()]

    @torch.no_grad()
    def diff(self, split: bool = True) -> tuple[Any, dict[str, int], int]:
        """(this rank's parts per HF tensor, its sum64 change per touched tensor, elements compared)
        of the current weights against the snapshot, which then holds the current weights. With
        ``split=False`` the first item is the raw changes per source (host tensors), to be cut into
        parts later by :meth:`split` (off the trainer's critical path).

        Four host reads in all, not two or more per source (what training waits for, and on a GPU shared with
        inference every read waits for the other process's kernels): the changed counts of every source,
        then (positions from ``nonzero_static`` at those counts) every source's sum64 change, and one
        copy each of all the changed positions and values (:func:`_to_host`). The comparison runs twice per source instead of keeping a mask per
        source (one byte per element) alive between the passes."""
        active = [s for s in self.sources if s.sends]
        compared = sum(_numel(s.local_shape) for s in active)
        counts = []
        for s in active:
            new, snap, iview = self._current(s)
            counts.append(torch.count_nonzero(new.view(iview) != snap.view(iview)))
        counts = torch.stack(counts).tolist() if counts else []
        raw: list[tuple[Source, torch.Tensor, torch.Tensor]] = []
        pending: list[tuple[Source, torch.Tensor]] = []
        for s, k in zip(active, counts):
            if k == 0:
                continue
            new, snap, iview = self._current(s)
            ch = _positions(new.view(iview) != snap.view(iview), k)
            vals, old = new[ch], snap[ch]
            snap.index_copy_(0, ch, vals)
            g = _to_global(ch, s)
            pending.append((s, self._seg_terms(s, g, bits(vals) - bits(old))))
            raw.append((s, g, vals))
        dsum = self._fold_sums(pending)
        return (self.split(_to_host(raw)) if split else _to_host(raw)), dsum, compared


    def split(self, raw: list) -> dict[str, list[Part]]:
        """Per-HF-tensor parts of :meth:`diff`'s raw changes (host tensors: views, no device work)."""
        parts: dict[str, list[Part]] = {}
        for s, g, vals in raw:
            self._split(s, g, vals, parts)
        return parts

    @staticmethod
    def _split(s: Source, g: torch.Tensor, vals: torch.Tensor, parts: dict[str, list[Part]]) -> None:
        """Cut one source's changes into per-HF-tensor parts (host tensors; views)."""
        if len(s.seg_starts) == 1:
            parts.setdefault(s.seg_names[0], []).append(Part(g, vals))
            return
        starts = torch.tensor(s.seg_starts, dtype=torch.int64)
        seg = torch.searchsorted(starts, g, right=True) - 1
        counts = torch.bincount(seg, minlength=len(s.seg_starts)).tolist()
        local = g - starts[seg]
        for n, pos, v in zip(s.seg_names, local.split(counts), vals.split(counts)):
            if pos.numel():
                parts.setdefault(n, []).append(Part(pos, v))

    def full_values(self) -> Optional[dict[str, torch.Tensor]]:
        """Every HF tensor as a view of a copy of the snapshot, when this rank holds every source whole
        (one rank, or unsharded): an anchor can then be written from it while training goes on.
        None otherwise (the caller gathers a full step through the stream instead)."""
        if not all(s.sends and s.local_shape == s.global_shape for s in self.sources):
            return None
        out = {}
        for s in self.sources:
            full = self.snap[s.name].clone()
            for start, n, numel in zip(s.seg_starts, s.seg_names, s.seg_numels):
                out[n] = full[start:start + numel].view(self.shapes[n])
        return out
