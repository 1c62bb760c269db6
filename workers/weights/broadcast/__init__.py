"""Broadcast weight transport (``weights.transport=broadcast``): trainer ranks send buckets
straight into inference memory over one torch.distributed group (gloo on CPU, NCCL on GPU).

Who waits for whom (every wait has a deadline: ``weights.broadcast_timeout_s``, naming
the peer):

Setup, once (trainer rank 0 hosts the group's TCPStore):
  T  every trainer rank publishes weights step 0 through the filesystem (workers boot
     from it), then rank 0 opens the store, writes ``weights/broadcast/group.json``
     (handshake.py); each sender puts its share's manifest on the store and waits for
     every receiver to join.
  O  the orchestrator (coordinator.py), once every worker is ready, reads group.json and POSTs
     ``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
     group_name, backend} to every worker at once; each worker (BroadcastReceiver) joins
     the store, says which experts it holds, and answers once its backends exist.
  all members compute the same bucket plan and create their backends (group.py).

Per update V (after trainer step V-1):
  T  rank 0 writes ``offer.json`` {V}; every sender waits for ``request.json`` == V (or the
     orchestrator's DONE: nobody will receive any more, sending stops for the run).
  O  sees the offer: ``/pause_generation`` (in_place) on every worker, writes request.json,
     POSTs ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name,
     weight_version: V, ...} to every worker at once, then ``/continue_generation``.
  T  each sender, per bucket of its own (plan order): pack (zero-copy for a lone tensor),
     checksum, broadcast the header [magic, V, bucket, nbytes, checksum] then the data.
  W  the worker (receiver.py) posts a receive for every bucket it needs into its
     preallocated staging buffer, checks each header and checksum as the bucket lands (hashing in threads
     while later buckets arrive), checks names/dtypes/shapes against the announced
     metadata and its model, and only then copies into the model. Any failure drains
     the remaining buckets (the senders are never left hanging) and refuses the update:
     the worker keeps serving the weights it had.

Sparse patches (``weights.delta``, embedded workers; delta_wire.py): the group also has one backend
per sender with every receiver. Rank 0 offers V with ``delta: true`` when V can go as a patch on V-1
(every sender's snapshot holds V-1 and no anchor is due: a full update every ``delta_full_every``).
O requests ``{mode: delta}`` unless a worker may lack V-1 (a refusal, a failed update, a revived
worker), then ``full``. For a patch each sender diffs its shards against its snapshot (the ranks'
digest changes all-gathered), broadcasts a header and its blob + manifest; each worker applies in
place, verified by every touched tensor's sum64, or refuses keeping its weights; the next version then
goes whole (buckets), which re-anchors the senders' snapshots.

A worker that died (and was respawned: the local launcher, or launcher/supervisor.py on Slurm):
  O  requests no update while a member is dead; once every dead worker answers its health
     check: /destroy_weights_update_group on the live ones, ``reform.json`` {G+1}.
  T  each sender, waiting for a request, sees it: drops its backends, forms generation G+1 on
     the same store under a new group name; rank 0 rewrites group.json {generation: G+1}.
  O  POSTs /init_weights_update_group to every worker; the revived ones (booted from step 0 on
     disk) are readmitted once the next update, a full one, reached them.
A death in the middle of a transfer fails that version (the senders skip it, the live workers
refuse it once their receives time out) and the next one goes to the re-formed group.

SGLang servers (inference.backend=sglang) cannot receive buckets: for them the same transport
speaks SGLang's own protocol (sglang/wire.py has the pinned 0.5.23 receive path):
  T  rank 0 writes group.json (protocol "sglang", names/dtypes/shapes in inference.dtype,
     load_format, bucket_bytes) and becomes rank 0 of SGLang's group (TCPStore host).
  O  /init_weights_update_group to every server at once, rank_offset = 1 + the TP ranks of
     the servers before it (sglang/broadcast_coordinator.py).
  per update V: T offers V; O pauses (in_place), writes request.json, then on every server
     begin -> one /update_weights_from_distributed per batch -> end; T streams each batch
     (gathered tensor by tensor from the trainer ranks: sglang/broadcast_publisher.py) as SGLang
     receives it (one broadcast per tensor, or one flattened bucket per call); T writes
     samples.json (weights.verify_fraction of the tensors, as sent); O reads them back with
     /get_weights_by_name, writes verdict.json; on a mismatch T publishes weights/step_V and
     O loads it from disk; O continues every server.
  with weights.delta, V offered as a patch (every server holds V-1): T diffs (every rank its shards),
     rank 0 merges the ranks' parts and writes patch.json (the descriptor); O posts it on every server
     inside begin/end as /update_weights_from_tensor with load_format = our --custom-weight-loader
     (sglang/patch_loader.py), whose every rank receives the patch broadcast by T on SGLang's group and
     applies it in place, verified; O reads every rank's verdict, writes verdict.json; a refusal: V
     through the filesystem, as above. Every delta_full_every versions T also writes V to disk (the
     anchor fresh servers boot from); the servers stay on patches.
Modules: publisher.py (T), coordinator.py (O), receiver.py (W), group.py (the group and the
bucket plan every member derives the same way), handshake.py (the marker files, torch-free);
workers/weights/sglang/ (wire.py, broadcast_publisher.py, broadcast_coordinator.py) for SGLang servers. This module is
torch-free (the launcher reads it): the config, the check and the spec.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import NONEMPTY, between, gt, limits, one_of
from workers.common.dtypes import held_dtype
from workers.common.registry import MODELS, TRANSPORTS, speaks_sglang
from workers.weights.delta.config import DeltaWeightsConfig
from workers.weights.sglang.patch_cost import delta_update_cost, model_split, server_layouts
from workers.weights.sglang.wire import BULK_EFFICIENCY, FORMATS, ITEM_BYTES, WEIGHTS_BY_NAME_ARCHITECTURES, update_cost
from workers.weights.spec import TransportSpec, lazy


@dataclasses.dataclass(kw_only=True)
class BroadcastWeightsConfig(DeltaWeightsConfig):
    """``weights/broadcast.yaml``. Steps on disk as well (DeltaWeightsConfig): step 0 goes through run_dir/weights."""

    transport: str = "broadcast"
    """``broadcast``: this schema's transport."""
    bucket_size_mb: int = 64
    """Bucket size in MiB; smaller tensors of one dtype and one receiver set are packed into
    buckets up to this. Several buckets let checksums and packing overlap the transfer; each
    broadcast also costs ~1 ms of fixed overhead on gloo (benchmarks/weight_sync.py)."""
    lone_tensor_mb: int = 16
    """Tensors of this many MiB or more travel alone, straight from their own memory (no packing copy)."""
    broadcast_timeout_s: float = 300.0
    """Deadline of forming the group and of each update (the orchestrator's request, every
    bucket); the error names the peer that did not show up."""
    backend: str = "auto"
    """``auto`` (NCCL when the trainer has CUDA, else gloo), ``gloo`` or ``nccl``."""
    group_name: str = "slurmrl_weights"
    """SGLang's ``group_name`` of the weight-update group."""
    sglang_format: str = "flattened_bucket"
    """SGLang servers only: ``flattened_bucket`` (one broadcast per /update_weights_from_distributed
    call of up to bucket_size_mb) or ``per_tensor`` (one broadcast per tensor, SGLang's default)."""
    verify_fraction: float = 0.0
    """SGLang servers only: fraction of the tensors read back with /get_weights_by_name after each
    update (a new draw every version) and compared with what the trainer sent; a mismatch sends
    that version through the filesystem instead. 0: no read-back. Only model classes that
    implement get_weights_by_name in SGLang can be read (workers/weights/sglang/wire.py: WEIGHTS_BY_NAME_ARCHITECTURES)."""
    verify_rows: int = 2
    """Rows of each sampled tensor read back (SGLang's truncate_size)."""


limits(BroadcastWeightsConfig, bucket_size_mb=gt(0), lone_tensor_mb=gt(0), broadcast_timeout_s=gt(0),
       backend=one_of("auto", "gloo", "nccl"), group_name=NONEMPTY, sglang_format=one_of(*FORMATS),
       verify_fraction=between(0.0, 1.0), verify_rows=gt(0))


def check(cfg) -> None:
    """Plan-time: patches into SGLang only in the dtype the servers hold; sampled read-back only where
    SGLang's model class can answer it."""
    w = cfg.weights
    if w.delta and speaks_sglang(cfg) and cfg.trainer.dtype != cfg.inference.dtype:
        raise ValueError(f"weights.delta=true into SGLang: patches carry the trainer's {cfg.trainer.dtype} values and "
                         f"the servers hold inference.dtype={cfg.inference.dtype}; a patch applies element by element "
                         f"only where both match (set inference.dtype={cfg.trainer.dtype} or weights.delta=false)")
    if not speaks_sglang(cfg) or w.verify_fraction == 0:
        return
    archs = MODELS.get(cfg.model.family).hf_architectures or ()
    if not set(archs) & set(WEIGHTS_BY_NAME_ARCHITECTURES):
        raise ValueError(f"weights.verify_fraction={w.verify_fraction}: SGLang 0.5.23's {'/'.join(archs) or '?'} "
                         f"has no get_weights_by_name (only {list(WEIGHTS_BY_NAME_ARCHITECTURES)} do), so the "
                         f"servers cannot be read back; set weights.verify_fraction=0")


def update_line(cfg, num_params: float) -> str:
    """Bytes per inference GPU per update and seconds at cluster.nic_gb_s, with the assumptions: dense
    broadcast into SGLang (sglang/wire.update_cost), or sparse patches with ``weights.delta``
    (sglang/patch_cost.delta_update_cost); both are the simulator's figures too. "" for dense embedded workers."""
    w, nic = cfg.weights, cfg.cluster.nic_gb_s
    if w.delta:
        return delta_line(cfg)
    if not speaks_sglang(cfg):
        return ""
    per_gpu, seconds = update_cost(num_params * ITEM_BYTES[cfg.inference.dtype], nic)
    return (f"broadcast into SGLang ({w.sglang_format}): {per_gpu / 1e9:.1f} GB per inference GPU per "
            f"update (every server rank receives the whole model in {cfg.inference.dtype}), ~{seconds:.1f} s at "
            f"cluster.nic_gb_s={nic:g} x {BULK_EFFICIENCY} NCCL efficiency")


def delta_line(cfg) -> str:
    """The plan's line for sparse patches: what every GPU receives now, and what per-rank delivery would."""
    w, nic, dtype = cfg.weights, cfg.cluster.nic_gb_s, held_dtype(cfg.inference.dtype)
    sglang = speaks_sglang(cfg)
    c = delta_update_cost(model_split(cfg.model), server_layouts(cfg) if sglang else [],
                          item_bytes=ITEM_BYTES[dtype], fraction=w.delta_fraction_assumed, nic_gb_s=nic,
                          senders=cfg.trainer.num_ranks)
    target = "into SGLang (custom weight loader)" if sglang else "buckets into the embedded workers"
    line = (f"sparse patches {target}: {c.whole_bytes_per_gpu / 1e9:.1f} GB per inference GPU per update "
            f"(dense {c.dense_bytes_per_gpu / 1e9:.1f} GB), ~{c.whole_s:.2f} s at cluster.nic_gb_s={nic:g} x "
            f"{BULK_EFFICIENCY} NCCL efficiency; assumes weights.delta_fraction_assumed={c.fraction:g} of the "
            f"{dtype} elements change per update ({c.bytes_per_element:.3f} B/element: sparse int32 index + value "
            f"or bitmap)")
    line += (f"; anchors every {w.delta_full_every} updates are written to run_dir/weights for fresh servers (a "
             f"refused patch: that version goes there and every server loads it)" if sglang else
             f"; an anchor (full broadcast) every {w.delta_full_every} updates")
    if sglang:
        line += (f"; every rank of a server receives the whole patch (SGLang 0.5.23 gives every member of its "
                 f"update group the same bytes); per-rank delivery (each rank its experts, {c.senders} trainer "
                 f"ranks sending) would be {c.rank_bytes_per_gpu / 1e9:.2f} GB per GPU, ~{c.rank_s:.2f} s")
    return line


SPEC = TRANSPORTS.register(TransportSpec(
    name="broadcast", config=BroadcastWeightsConfig, check=check, backends=("embedded", "sglang"),
    summary="trainer ranks broadcast into inference memory: buckets (embedded) or SGLang's protocol (step 0 on disk)",
    publisher=lazy("workers.weights.broadcast.publisher:make_publisher"),
    coordinator=lazy("workers.weights.broadcast.coordinator:make_coordinator"),
    receiver=lazy("workers.weights.broadcast.receiver:make_receiver"), update_line=update_line))
