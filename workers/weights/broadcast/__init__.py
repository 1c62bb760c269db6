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

A worker that died (and was respawned: the local launcher, or launcher/supervisor.py on Slurm):
  O  requests no update while a member is dead; once every dead worker answers its health
     check: /destroy_weights_update_group on the live ones, ``reform.json`` {G+1}.
  T  each sender, waiting for a request, sees it: drops its backends, forms generation G+1 on
     the same store under a new group name; rank 0 rewrites group.json {generation: G+1}.
  O  POSTs /init_weights_update_group to every worker; the revived ones (booted from step 0 on
     disk) are readmitted once the next update, a full one, reached them.
A death in the middle of a transfer fails that version (the senders skip it, the live workers
refuse it once their receives time out) and the next one goes to the re-formed group.

Only the embedded engine speaks the bucket protocol (SGLang servers receive per tensor), so
the plan refuses inference.backend=sglang (:func:`check`). Modules: publisher.py (T),
coordinator.py (O), receiver.py (W), group.py (the group and the bucket plan every member
derives the same way), handshake.py (the marker files, torch-free). This module is
torch-free (the launcher reads it): the config, the check and the spec.
"""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import NONEMPTY, gt, limits, one_of
from workers.common.registry import TRANSPORTS
from workers.weights.filesystem import FilesystemWeightsConfig
from workers.weights.spec import TransportSpec, lazy


@dataclasses.dataclass(kw_only=True)
class BroadcastWeightsConfig(FilesystemWeightsConfig):
    """``weights/broadcast.yaml``. A filesystem config as well: step 0 goes through run_dir/weights."""

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


limits(BroadcastWeightsConfig, bucket_size_mb=gt(0), lone_tensor_mb=gt(0), broadcast_timeout_s=gt(0),
       backend=one_of("auto", "gloo", "nccl"), group_name=NONEMPTY)


def check(cfg) -> None:
    """Plan-time: only the embedded engine receives buckets; the group's settings make sense."""
    if cfg.inference.backend == "sglang":
        raise ValueError("weights.transport=broadcast speaks the embedded engine's bucket protocol "
                         "(workers/weights/broadcast/), which SGLang servers cannot receive; with "
                         "inference.backend=sglang use weights.transport=filesystem")
    # the group's settings: their ranges and choices (limits above), checked by check_transport


SPEC = TRANSPORTS.register(TransportSpec(
    name="broadcast", config=BroadcastWeightsConfig, check=check, backends=("embedded",),
    summary="trainer ranks broadcast buckets into the embedded workers' memory (step 0 on disk)",
    publisher=lazy("workers.weights.broadcast.publisher:make_publisher"),
    coordinator=lazy("workers.weights.broadcast.coordinator:BroadcastCoordinator"),
    receiver=lazy("workers.weights.broadcast.receiver:make_receiver")))
