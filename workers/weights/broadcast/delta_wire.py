"""Sparse patches over the bucket group (weights.delta, embedded workers): both ends of one patch update.

Why a second message shape beside the buckets: a patch is a few percent of the model and its size is
known only after the optimizer step, so it cannot follow the bucket plan that every member derived at
formation. Each sender broadcasts, on the backend of (itself + every receiver) (created at formation
when the plan config says ``delta``):

  header   int64 [DMAGIC, version, sender, payload bytes, manifest bytes, checksum hi, lo]
  payload  uint8: the sender's safetensors blob (workers/weights/delta/patch.encode), then its manifest
           as JSON {"parts": {name: [part entries]}, "sums": {name: hex sum64}}

``sums`` (sender 0 only): every touched tensor's digest after this version, the totals over all trainer
ranks (their changes are all-gathered before sending, so every sender knows them). A receiver checks
each header and the payload's xxh3, decodes (each part checked again), keeps the parts of the tensors
it holds, and applies them in place with workers/weights/delta/apply.apply_parts: every touched
tensor's sum64 must come out as announced, or the worker keeps the weights it had (refused: the
orchestrator sends the next version whole to everyone).
"""
from __future__ import annotations

import json
from typing import Mapping, Optional, Sequence

import torch

from workers.weights.base import Peers, WeightLoadError
from workers.weights.broadcast.group import WeightGroup, holds
from workers.weights.checksums import buffer_checksum, digest_from_int64, digest_int64
from workers.weights.delta.apply import apply_parts
from workers.weights.delta.patch import Part, decode, encode
from workers.weights.delta.sum64 import MASK, hex64, tensor_sum64
from workers.weights.delta.tracker import DeltaTracker
from workers.weights.shards import dtype_from_name

DMAGIC = 0x444C5441  # "DLTA"
DHEADER_LEN = 7


def delta_members(sender: int, receivers: Sequence[int]) -> tuple[int, ...]:
    """The member set a sender's patches travel on: itself and every receiver."""
    return tuple(sorted({sender, *receivers}))


def patch_payload(parts: Mapping[str, list[Part]], sums: Mapping[str, int], numels: Mapping[str, int],
                  dtypes: Mapping[str, str]) -> tuple[bytes, int]:
    """(blob + manifest JSON, manifest length): one sender's payload, as delta_wire's receivers and the
    SGLang loader (sglang/patch_loader.py) read it. ``sums``: digests after this version ({} but on
    sender 0); ``dtypes``: the published dtype of every patched tensor."""
    blob, manifest = encode(parts, numels)
    meta = {"parts": manifest, "sums": {n: hex64(v) for n, v in sums.items()},
            "dtypes": {n: dtypes[n] for n in manifest}}
    mbytes = json.dumps(meta).encode()
    return blob + mbytes, len(mbytes)


class PatchSender:
    """One trainer rank's side: its tracker (snapshot of what it sent last), the totals of every
    tensor's sum64 over all ranks, and the broadcast of its patch."""

    def __init__(self, stream, peers: Peers, *, on_host: bool = False):
        self.peers = peers
        self.tracker = DeltaTracker(stream, list(stream.metas), peers, on_host=on_host)
        self.dtypes = {m.name: m.dtype for m in stream.metas}
        self.totals: dict[str, int] = {}

    def repoint(self, stream) -> None:
        """Read the stream's current tensors (a state dict handed anew each publish)."""
        state = getattr(stream, "state", {})
        for s in self.tracker.sources:
            t = state.get(s.name)
            if t is not None and tuple(t.shape) == tuple(s.tensor.shape):
                s.tensor = t

    def anchor(self) -> None:
        """After a full send: snapshot everything as sent, totals from every rank's partial sums.
        COLLECTIVE over the trainer ranks."""
        partial = self.tracker.reset()
        everyone = self.peers.all_gather_object(partial) if self.peers.world_size > 1 else [partial]
        self.totals = {}
        for p in everyone:
            for n, v in p.items():
                self.totals[n] = (self.totals.get(n, 0) + v) & MASK

    def diff(self) -> tuple[dict[str, list[Part]], dict[str, int], int, int]:
        """(this rank's parts, totals of every touched tensor after them, elements changed here, elements
        compared here). COLLECTIVE: the ranks' sum64 changes are all-gathered."""
        parts, dsum, compared = self.tracker.diff()
        everyone = self.peers.all_gather_object(dsum) if self.peers.world_size > 1 else [dsum]
        touched: dict[str, int] = {}
        for d in everyone:
            for n, v in d.items():
                self.totals[n] = (self.totals.get(n, 0) + v) & MASK
                touched[n] = self.totals[n]
        changed = sum(p.count for ps in parts.values() for p in ps)
        return parts, touched, changed, compared

    def send(self, group: WeightGroup, version: int, parts: Mapping[str, list[Part]], sums: Mapping[str, int],
             receivers: Sequence[int]) -> int:
        """Broadcast this rank's header and payload; returns payload bytes (blocks until sent)."""
        raw, mlen = patch_payload(parts, sums if group.rank == 0 else {}, self.tracker.numels, self.dtypes)
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device)
        checksum = buffer_checksum(payload)
        header = torch.tensor([DMAGIC, version, group.rank, payload.numel(), mlen, *digest_int64(checksum)],
                              dtype=torch.int64, device=group.device)
        members = delta_members(group.rank, receivers)
        works = [group.broadcast_on(members, header, group.rank), group.broadcast_on(members, payload, group.rank)]
        for w in works:
            group.wait(w, f"sending the patch of v{version}")
        return int(payload.numel())


class PatchReceiver:
    """One worker's side: the sum64 of every tensor it holds (computed when first needed after a full
    load, then kept from the patches) and the receive-check-apply of one patch version."""

    def __init__(self, dtypes: Mapping[str, str], experts: Optional[Sequence[int]] = None):
        self.dtypes = dict(dtypes)
        self.experts = experts
        self.sums: dict[str, int] = {}

    def invalidate(self) -> None:
        """The weights were replaced wholesale (a full update): digests are recomputed on demand."""
        self.sums.clear()

    def receive(self, group: WeightGroup, version: int, senders: Sequence[int]) -> tuple[list, int]:
        """Every sender's (header, payload) as received; raises WeightLoadError (after draining) on a
        bad header or checksum. Returns ([(sender, payload bytes, manifest length)], bytes)."""
        dev = group.device
        heads = []
        for s in senders:
            h = torch.empty(DHEADER_LEN, dtype=torch.int64, device=dev)
            heads.append((s, h, group.broadcast_on(delta_members(s, group.receivers), h, s)))
        errors, posted = [], []
        for s, h, w in heads:
            group.wait(w, f"receiving the patch header of v{version} from trainer rank {s}")
            magic, v, sender, n, mlen, hi, lo = h.tolist()
            if (magic, v, sender) != (DMAGIC, version, s) or not 0 < mlen <= n:
                errors.append(f"patch header from trainer rank {s} says magic {magic:#x}, version {v}, sender "
                              f"{sender}; expected {DMAGIC:#x}, {version}, {s}")
            buf = torch.empty(max(0, n), dtype=torch.uint8, device=dev)
            posted.append((s, buf, mlen, digest_from_int64(hi, lo),
                           group.broadcast_on(delta_members(s, group.receivers), buf, s)))
        out, nbytes = [], 0
        for s, buf, mlen, want, w in posted:
            group.wait(w, f"receiving the patch of v{version} from trainer rank {s}")
            nbytes += buf.numel()
            if buffer_checksum(buf) != want:
                errors.append(f"patch of v{version} from trainer rank {s} fails its checksum (corrupt in transit)")
            out.append((s, bytes(buf.cpu().numpy()), mlen))
        if errors:
            raise WeightLoadError(f"patch v{version} refused: " + "; ".join(errors[:3]))
        return out, nbytes

    def apply(self, params: Mapping[str, torch.Tensor], received: list, *, version: int) -> int:
        """Decode every sender's payload, keep what this worker holds, apply verified (or roll back).
        Returns the number of changed elements applied."""
        where = f"patch v{version}"
        parts: dict[str, list[Part]] = {}
        expected: dict[str, int] = {}
        for s, raw, mlen in received:
            try:
                meta = json.loads(raw[len(raw) - mlen:].decode())
                manifest, sums = meta["parts"], meta["sums"]
            except (ValueError, KeyError, TypeError) as e:
                raise WeightLoadError(f"{where}: unreadable manifest from trainer rank {s} ({e})") from None
            for n, v in sums.items():
                expected[n] = int(v, 16)
            unknown = sorted(set(manifest) - set(self.dtypes))
            if unknown:
                raise WeightLoadError(f"{where}: trainer rank {s} patches tensors the group never announced, "
                                      f"e.g. {unknown[:3]}")
            for n, plist in decode(raw[:len(raw) - mlen], manifest, dtypes=self.dtypes, where=where).items():
                if holds(self.experts, n):
                    parts.setdefault(n, []).extend(plist)
        missing = sorted(n for n in parts if n not in expected)
        if missing:
            raise WeightLoadError(f"{where}: no digest announced for patched tensor {missing[0]}")
        for n in parts:
            if n not in self.sums:
                if n not in params:
                    raise WeightLoadError(f"{where}: patch names tensor {n}, which this model does not have")
                self.sums[n] = tensor_sum64(params[n].detach().to(dtype_from_name(self.dtypes[n])))
        self.sums = apply_parts(params, parts, self.sums, expected, where=where)
        return sum(p.count for ps in parts.values() for p in ps)
