"""Receiver side of sparse deltas: verify a chain of patches against what the receiver holds, then write it.

:func:`stage_chain` composes one or several versions' parts (a receiver catching up from an older base)
per storage they land in (a model's ``state_dict()`` gives per-expert tensors as views of their stacks,
so an expert stack is ONE group, never a Python loop of device ops per expert): the union of the
positions they touch, the values there now (read, never written), then each version's values over them
in order. Each touched tensor's sum64 (workers/weights/delta/sum64.py) is updated from the old and new
values, in the published dtype, and compared with that version's manifest. Nothing live changes while
staging, so a mismatch raises :class:`~workers.weights.base.WeightLoadError` with the receiver serving
the version it had, and staging may run beside a forward that reads the same weights (the embedded
engine stages while it decodes: workers/inference/embedded/weight_swap.py). :meth:`StagedPatches.commit`
then writes each group with one ``index_copy_``: the only part that must not overlap a forward.
:func:`apply_chain` / :func:`apply_parts` do both at once.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

from workers.weights.base import WeightLoadError
from workers.weights.delta.patch import Part, check_bounds
from workers.weights.delta.sum64 import MASK, bits, segment_sums_device

PACK_ON_CPU = False
"""Tests: pack a CPU model's copies as a GPU's are packed (one buffer per dtype, split into views), so the
packing runs where there is no GPU."""

Chain = Sequence[tuple[Mapping[str, list[Part]], Mapping[str, int], str]]
"""(parts by tensor name, every tensor's sum64 after that version, where: for messages), oldest first."""


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the whole storage ``t`` lives in (its stack, for an expert's view)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0)


@dataclasses.dataclass
class StagedPatches:
    """A verified chain, not yet written: per storage, the positions it touches and their final values."""

    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(flat storage view, positions, values in the storage's dtype), values on the storage's device."""
    sums: dict[str, int]
    """Every tensor's sum64 once committed."""

    @torch.no_grad()
    def commit(self) -> dict[str, int]:
        for flat, pos, vals in self.writes:
            flat.index_copy_(0, pos, vals)
        return self.sums


@torch.no_grad()
def apply_parts(params: Mapping[str, torch.Tensor], parts: Mapping[str, list[Part]], sums: dict[str, int],
                expected: Mapping[str, int], *, where: str) -> dict[str, int]:
    """Apply one version's ``parts`` to ``params`` and return the new sums (``sums``: the per-tensor
    sum64 the receiver holds now; ``expected``: the manifest's after this version). Raises
    WeightLoadError with every tensor as it was on a bounds, dtype or digest problem."""
    return apply_chain(params, [(parts, expected, where)], sums)


@torch.no_grad()
def apply_chain(params: Mapping[str, torch.Tensor], chain: Chain, sums: Mapping[str, int]) -> dict[str, int]:
    """Apply several versions' parts in order; all or nothing (nothing is written unless every
    version verifies)."""
    return stage_chain(params, chain, sums).commit()


def _groups(params: Mapping[str, torch.Tensor], parts: Mapping[str, list[Part]], where: str) -> dict[int, dict]:
    """One version's parts per storage, concatenated on the host (one device copy per group)."""
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
            g = groups.setdefault(t.untyped_storage().data_ptr(), {"t": t, "pos": [], "vals": [], "seg": [],
                                                                     "local": [], "names": []})
            if name not in g["names"]:
                g["names"].append(name)
            g["pos"].append(p.positions + t.storage_offset())
            g["local"].append(p.positions)
            g["vals"].append(p.values)
            g["seg"].append(torch.full((p.count,), g["names"].index(name), dtype=torch.int64))
    return _to_devices(groups)


def _to_devices(groups: dict[int, dict]) -> dict[int, dict]:
    """Each group's host lists as device tensors, with one host->device copy per (device, dtype) for the
    whole version instead of four per storage: a model of ~300 tensors made ~1200 small pageable copies,
    each waiting for the decode work queued before it on the engine's stream. Pinned, so the copies run
    asynchronously; the groups' tensors are views of the copied buffers."""
    flat = {key: {k: torch.cat(g[k]) for k in ("pos", "local", "vals", "seg")} for key, g in groups.items()}
    host_only = {key for key, g in groups.items() if g["t"].device.type == "cpu" and not PACK_ON_CPU}
    dev: dict[int, dict] = {key: {"t": g["t"], "names": g["names"], **(flat[key] if key in host_only else {})}
                            for key, g in groups.items()}  # on the host already: nothing to copy
    buckets: dict[tuple, list[tuple[int, str]]] = {}
    for key, g in groups.items():
        if key not in host_only:
            for k, t in flat[key].items():
                buckets.setdefault((g["t"].device, t.dtype), []).append((key, k))
    for (device, _), members in buckets.items():
        host = torch.cat([flat[key][k] for key, k in members])
        host = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        sizes = [flat[key][k].numel() for key, k in members]
        for (key, k), view in zip(members, torch.split(host, sizes)):
            dev[key][k] = view
    return dev


@torch.no_grad()
def stage_chain(params: Mapping[str, torch.Tensor], chain: Chain, sums: Mapping[str, int]) -> StagedPatches:
    """Verify ``chain`` against ``params`` (read only) and return what committing it writes (module docstring)."""
    versions = [(_groups(params, parts, where), expected, parts, where) for parts, expected, where in chain]
    touched: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # storage -> (flat view, each version's positions)
    for groups, _, _, _ in versions:
        for key, g in groups.items():
            touched.setdefault(key, (_flat_storage(g["t"]), []))[1].append(g["pos"])
    union: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # storage -> (flat, positions, values)
    for key, (flat, pos_list) in touched.items():
        pos = pos_list[0] if len(pos_list) == 1 else torch.unique(torch.cat(pos_list))  # sorted, unique
        union[key] = (flat, pos, flat[pos])  # the values there now: a gather, nothing written
    cur = dict(sums)
    for groups, expected, parts, where in versions:
        found, names = [], []
        for key, g in groups.items():
            flat, pos, vals = union[key]
            idx = None if pos is g["pos"] else torch.searchsorted(pos, g["pos"])  # None: only this version
            old = vals if idx is None else vals[idx]
            new = g["vals"]
            found.append(segment_sums_device(bits(new) - bits(old.to(new.dtype)), g["local"], g["seg"], len(g["names"])))
            names += g["names"]
            if idx is None:
                union[key] = (flat, pos, new.to(flat.dtype))
            else:
                vals[idx] = new.to(flat.dtype)
        deltas = torch.cat(found).tolist() if found else []  # one device read per version
        for name, v in zip(names, deltas):
            cur[name] = (cur.get(name, 0) + v) & MASK
        bad = [n for n in parts if cur.get(n) != expected.get(n)]
        if bad:
            raise WeightLoadError(f"{where}: tensor {bad[0]} does not match the trainer's digest after applying the "
                                  f"patch (sum64 {cur.get(bad[0], 0):016x} != {expected.get(bad[0], 0):016x}; "
                                  f"{len(bad)} tensors): either the receiver did not hold the patch's base, or the "
                                  f"patch's values are not the trainer's (the step was altered after it was published)")
    return StagedPatches(writes=list(union.values()), sums=cur)
