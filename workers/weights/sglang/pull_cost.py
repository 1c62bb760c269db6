"""The plan's ``weights:`` line for ``weights.transport=filesystem`` + ``weights.delta`` into SGLang (torch-free).

Why a line of its own: over the filesystem each SGLang rank pulls from run_dir/weights only the patch
bytes of the tensors it holds (patch_pull.py), so what one inference GPU moves per update is the
"per rank" figure of workers/weights/sglang/patch_cost.py (its routed experts' share plus every
non-expert tensor whole), not the whole patch that a broadcast gives every rank.

Two limits, and the update takes the slower (:func:`pull_seconds`; the simulator calls the same):
  per GPU   the largest rank's share at ``cluster.nic_gb_s``;
  storage   what the shared filesystem serves for all servers at once at ``cluster.shared_fs_gb_s``
            (:func:`pull_storage_bytes`): every rank of a node reads the same non-expert entries, which
            the node's client cache serves after the first read, so each node fetches them once, plus
            the experts its ranks hold (each server's EP ranks together hold every expert once, plus
            EPLB's redundant copies).
The storage term decides for big fleets: 96 GLM-5 server ranks reading 4.25 GB each would be 0.09 s at
the NIC but several seconds from a 100 GB/s scratch filesystem, where the whole-patch broadcast is faster.
The line prints both, so the user can pick the transport on their own filesystem's figure.
"""
from __future__ import annotations

import math
from typing import Sequence


def pull_storage_bytes(split, layouts: Sequence, *, bytes_per_element: float, gpus_per_node: int) -> float:
    """Bytes the shared filesystem serves per update when every server rank pulls its share (module doc).
    ``split``/``layouts``: patch_cost.ModelSplit / ServerLayout; ``gpus_per_node`` <= 0 counts one rank per node."""
    total = 0.0
    for lay in layouts:
        per_node = max(1, min(lay.tp, gpus_per_node)) if gpus_per_node > 0 else 1
        nodes = math.ceil(lay.tp / per_node)
        if split.num_experts and lay.ep > 1:  # every expert (+ EPLB copies) once over the server's EP ranks
            routed = split.routed * (split.num_experts + lay.redundant_experts) / split.num_experts
        else:  # every rank holds every expert: once per node
            routed = split.routed * nodes
        total += lay.count * (nodes * split.other + routed) * bytes_per_element
    return total


def pull_seconds(rank_bytes_per_gpu: float, storage_bytes: float, *, nic_gb_s: float, fs_gb_s: float) -> float:
    """Seconds one pulled update takes: the slower of the largest rank's NIC and the filesystem's aggregate."""
    return max(rank_bytes_per_gpu / (nic_gb_s * 1e9), storage_bytes / (fs_gb_s * 1e9))


def update_line(cfg, num_params: float) -> str:
    """TransportSpec.update_line: "" unless patches go into SGLang servers (embedded workers read patch
    steps with their own DiskReader; dense steps cost what the model weighs)."""
    from workers.common.registry import speaks_sglang
    from workers.weights.sglang.patch_cost import delta_update_cost, model_split, server_layouts
    from workers.weights.sglang.wire import ITEM_BYTES

    w, nic, fs, dtype = cfg.weights, cfg.cluster.nic_gb_s, cfg.cluster.shared_fs_gb_s, cfg.inference.dtype
    if not w.delta or not speaks_sglang(cfg):
        return ""
    layouts, split = server_layouts(cfg), model_split(cfg.model)
    c = delta_update_cost(split, layouts, item_bytes=ITEM_BYTES[dtype], fraction=w.delta_fraction_assumed,
                          nic_gb_s=nic, senders=1, efficiency=1.0)
    storage = pull_storage_bytes(split, layouts, bytes_per_element=c.bytes_per_element,
                                 gpus_per_node=cfg.cluster.num_gpus_per_node)
    seconds = pull_seconds(c.rank_bytes_per_gpu, storage, nic_gb_s=nic, fs_gb_s=fs)
    ranks = sum(lay.count * lay.tp for lay in layouts)
    return (f"sparse patches pulled per rank from run_dir/weights (custom weight loader in every SGLang rank): "
            f"{c.rank_bytes_per_gpu / 1e9:.2f} GB per inference GPU per update (its routed experts' patches + every "
            f"other tensor's; the whole patch is {c.whole_bytes_per_gpu / 1e9:.2f} GB, dense "
            f"{c.dense_bytes_per_gpu / 1e9:.1f} GB), {c.rank_bytes_per_gpu / (nic * 1e9):.2f} s at cluster.nic_gb_s={nic:g}; "
            f"the shared filesystem serves {storage / 1e9:.1f} GB to all {ranks} server ranks (non-expert entries "
            f"once per node), {storage / (fs * 1e9):.2f} s at cluster.shared_fs_gb_s={fs:g}: ~{seconds:.2f} s per "
            f"update; assumes weights.delta_fraction_assumed={c.fraction:g} of the {dtype} elements change per update "
            f"({c.bytes_per_element:.3f} B/element: sparse int32 index + value or bitmap); anchors (every "
            f"{w.delta_full_every} updates) and refused patches: servers load a full step from disk (the anchor, or "
            f"the patch step resolved)")
