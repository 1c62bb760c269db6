"""Sparse weight deltas: what changed in the published dtype since the last version, and only that.

Why: the weight update is the loop's only sync point, and with fp32 master weights at RL
learning rates most published (bf16) elements do not change from one step to the next (a step
moves them by less than half an ulp): 1-3 % differ on MoE models. Sending the model every step
moves 30-100x more bytes than needed. Every transport speaks the same patches.

Pieces (torch-side modules import torch; this one does not):
  sum64.py    a 64-bit position-weighted sum per tensor, exact to update from a patch alone
              (old and new values at the changed positions), so trainer and receivers agree on
              every tensor's digest without re-reading the model;
  patch.py    one version's changes: per HF tensor, parts (a rank's box of it) as sorted flat
              indices or a bitmap over an index range, plus the new values; serialised to one
              safetensors file per sender with an xxh3 per part, and a manifest (JSON);
  tracker.py  trainer side: a snapshot of the last published values of this rank's shards (in
              the published dtype, on the device or pinned on the host), diffed after each
              optimizer step on the device; indices are mapped to each HF tensor's own flat
              positions (expert stacks split into per-expert tensors); replicated shards are sent
              by one rank only;
  apply.py    receiver side: parts grouped by the storage they land in (one index_copy per
              expert stack, not one per expert), the sum64 of every touched tensor updated from
              the old and new values and compared with the manifest; on any mismatch the old
              values go back (nothing serves mixed weights);
  index.py    a patch step's index.json: its schema check and every tensor's sum64 (all its readers);
  config.py   DeltaWeightsConfig, the fields of both step-publishing transports (torch-free).

Versions: a patch for version V names its ``base`` (V-1: the version it applies to) and its
``anchor`` (the newest full version at or before V). A receiver holding ``base`` applies V; one
holding an older version of the same chain applies the patches in between; any other (fresh,
respawned, or one that refused a patch) loads the anchor, then every patch after it. Anchors are
full steps, every ``weights.delta_full_every`` versions and after a trainer restart.
"""
from __future__ import annotations

FORMAT = "slurmrl-delta/1"
"""``format`` of a delta manifest (a filesystem step's index.json, a broadcast header)."""
ENCODINGS = ("sparse", "bitmap")
"""How one part lists the changed positions: sorted flat indices (int32 where they fit), or a bitmap
over [lo, hi) of the tensor's flat positions; the smaller one is chosen per part."""
DELTA_FRACTION_DEFAULT = 0.02
"""Changed fraction of the published bf16 elements per RL step assumed where nothing was measured:
public measurements at RL learning rates with fp32 master weights put it at 1-3 % (verl: 0.8-1.1 % on
MoE models; others report ~98 % of bf16 elements bit-identical between steps). 2 % is the middle of
that range; ``python -m benchmarks.weight_delta`` measures ours."""
DIGEST = "sum64"
"""Key of the per-tensor sum64 digest (hex) in manifests and index.json files."""


def patch_bytes_per_element(changed_fraction: float, item_bytes: int) -> float:
    """Bytes a patch costs per element of the model at ``changed_fraction`` (the cheaper encoding):
    sparse = fraction * (4-byte index + value), bitmap = 1/8 + fraction * value. Used by the plan."""
    sparse = changed_fraction * (4 + item_bytes)
    bitmap = 1 / 8 + changed_fraction * item_bytes
    return min(sparse, bitmap, item_bytes + 1 / 8)
