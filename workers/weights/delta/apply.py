"""Receiver side of sparse deltas: apply parts in place, verified, or not at all.

:func:`apply_parts` writes one version's parts into the live tensors (a dict name -> tensor, as a
model's ``state_dict()`` gives: per-expert tensors are views of their stacks). Parts are grouped by
the storage they land in, so an expert stack takes ONE ``index_copy_`` for all its experts (never a
Python loop of device ops per expert); the old values at those positions are kept. Each touched
tensor's sum64 (workers/weights/delta/sum64.py) is updated from the old and new values, in the
published dtype, and compared with the manifest's. On any mismatch every group is put back from the
kept old values before :class:`~workers.weights.base.WeightLoadError` is raised: the receiver serves
the version it had, never a mix.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from workers.weights.base import WeightLoadError
from workers.weights.delta.patch import Part, check_bounds
from workers.weights.delta.sum64 import MASK, bits, segment_sums


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the whole storage ``t`` lives in (its stack, for an expert's view)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0)


@torch.no_grad()
def apply_parts(params: Mapping[str, torch.Tensor], parts: Mapping[str, list[Part]], sums: dict[str, int],
                expected: Mapping[str, int], *, where: str) -> dict[str, int]:
    """Apply one version's ``parts`` to ``params`` and return the new sums (``sums``: the per-tensor
    sum64 the receiver holds now; ``expected``: the manifest's after this version). Raises
    WeightLoadError with every tensor as it was on a bounds, dtype or digest problem."""
    return apply_chain(params, [(parts, expected, where)], sums)


@torch.no_grad()
def apply_chain(params: Mapping[str, torch.Tensor], chain: Sequence[tuple[Mapping[str, list[Part]], Mapping[str, int], str]],
                sums: Mapping[str, int]) -> dict[str, int]:
    """Apply several versions' parts in order (a receiver catching up from an older base); all or
    nothing: a problem in any of them puts back every value the earlier ones changed."""
    undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    cur = dict(sums)
    try:
        for parts, expected, where in chain:
            cur = _apply_one(params, parts, cur, expected, where, undo)
    except BaseException:
        for flat, pos, old in reversed(undo):
            flat.index_copy_(0, pos, old)
        raise
    return cur


def _apply_one(params: Mapping[str, torch.Tensor], parts: Mapping[str, list[Part]], sums: dict[str, int],
               expected: Mapping[str, int], where: str, undo: list) -> dict[str, int]:
    unknown = sorted(set(parts) - set(params))
    if unknown:
        raise WeightLoadError(f"{where}: patch names {len(unknown)} tensors the model does not have, e.g. {unknown[:3]}")
    groups: dict[int, dict] = {}
    for name, plist in parts.items():
        t = params[name]
        if not t.is_contiguous():
            raise WeightLoadError(f"{where}: tensor {name} is not contiguous in this model: cannot patch it in place")
        for p in plist:
            check_bounds(name, p, t.numel(), where)
            g = groups.setdefault(t.untyped_storage().data_ptr(), {"flat": _flat_storage(t), "pos": [], "vals": [],
                                                                     "seg": [], "local": [], "names": []})
            if name not in g["names"]:
                g["names"].append(name)
            g["pos"].append(p.positions.to(t.device) + t.storage_offset())
            g["local"].append(p.positions.to(t.device))
            g["vals"].append(p.values.to(t.device))
            g["seg"].append(torch.full((p.count,), g["names"].index(name), dtype=torch.int64, device=t.device))
    new_sums = dict(sums)
    for g in groups.values():
        flat, pos, vals = g["flat"], torch.cat(g["pos"]), torch.cat(g["vals"])
        old = flat[pos]
        flat.index_copy_(0, pos, vals.to(flat.dtype))
        undo.append((flat, pos, old))
        got = segment_sums(bits(vals) - bits(old.to(vals.dtype)), torch.cat(g["local"]), torch.cat(g["seg"]),
                           len(g["names"]))
        for name, v in zip(g["names"], got):
            new_sums[name] = (new_sums.get(name, 0) + v) & MASK
    bad = [n for n in parts if new_sums.get(n) != expected.get(n)]
    if bad:
        raise WeightLoadError(f"{where}: tensor {bad[0]} does not match the trainer's digest after applying the "
                              f"patch (sum64 {new_sums.get(bad[0], 0):016x} != {expected.get(bad[0], 0):016x}; "
                              f"{len(bad)} tensors): either the receiver did not hold the patch's base, or the "
                              f"patch's values are not the trainer's (the step was altered after it was published)")
    return new_sums
