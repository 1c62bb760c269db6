"""What one sparse weight update costs the network, per inference GPU (torch-free: the plan and the simulator).

Why one function for both: the plan's ``weights:`` line and tools/simulator/costs.py must print the
same figure, and both must show the assumptions it rests on (the changed fraction, the patch's bytes
per element, the layout of every server, the number of trainer ranks sending).

Two delivery shapes, both computed so the plan can say what it does and what it leaves on the table:

``whole patch``  one patch per version, broadcast over SGLang's weight-update group (trainer rank 0 ->
                 every server rank; patch_loader.py receives it inside the server). SGLang
                 0.5.23's update paths give every rank of a group the same bytes: the broadcast of
                 ``/update_weights_from_distributed`` reaches every member, and the request of
                 ``/update_weights_from_tensor`` is re-broadcast to every TP rank of a server over its
                 CPU group (scheduler request_receiver, ``broadcast_pyobj``). So every inference GPU
                 receives the patch of the whole model: ``trained elements x patch bytes/element``,
                 pipelined along one NCCL broadcast at one NIC's rate.
``per rank``     each server rank receives only the patches of what it holds: its routed experts
                 (``(num_experts + redundant) / ep`` of them under EPLB) plus everything else whole
                 (attention is replicated over the DP-attention ranks; a TP-split dense tensor is
                 counted whole, as a sender that does not know SGLang's fused TP layout must send it),
                 pushed by all trainer ranks in parallel: ``max(bytes per GPU / NIC, bytes all GPUs
                 receive / (senders x NIC))``. Over the broadcast this is not built (what the plan line says);
                 ``weights.transport=filesystem`` builds it as a pull: each rank reads exactly these bytes
                 from the patch step on shared storage (workers/weights/sglang/pull_cost.py prints it).

Patch bytes per element: workers.weights.delta.patch_bytes_per_element (the cheaper of sorted
int32 indices + values and a bitmap + values; a dense tensor is capped at its own size + the bitmap).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from workers.weights.sglang.wire import BULK_EFFICIENCY
from workers.weights.delta import DELTA_FRACTION_DEFAULT, patch_bytes_per_element  # noqa: F401 (re-exported)

@dataclasses.dataclass(frozen=True)
class ServerLayout:
    """One kind of SGLang server of the plan: how many, and how each spreads the model over its GPUs."""

    count: int
    tp: int
    ep: int = 1
    dp_attention: int = 1
    redundant_experts: int = 0
    """EPLB's extra expert copies spread over the EP ranks (more experts per GPU)."""


@dataclasses.dataclass(frozen=True)
class ModelSplit:
    """Published elements: routed expert weights (split over EP) and everything else."""

    trained: float
    routed: float
    num_experts: int

    @property
    def other(self) -> float:
        return self.trained - self.routed


@dataclasses.dataclass(frozen=True)
class DeltaCost:
    fraction: float
    bytes_per_element: float
    """Patch bytes per model element at ``fraction`` (the item size of the dtype is dense)."""
    dense_bytes_per_gpu: float
    """The whole model in the inference dtype (what a dense broadcast gives every GPU)."""
    whole_bytes_per_gpu: float
    whole_s: float
    rank_bytes_per_gpu: float
    """Per rank: the largest share of any server rank."""
    rank_total_bytes: float
    """Per rank: what all server ranks receive together (the senders' load)."""
    rank_s: float
    senders: int


def rank_elements(split: ModelSplit, layout: ServerLayout) -> float:
    """Elements one rank of ``layout`` holds, as the per-rank delivery sends them (see the module doc)."""
    if split.num_experts and layout.ep > 1:
        routed = split.routed * (split.num_experts + layout.redundant_experts) / layout.ep / split.num_experts
    else:
        routed = split.routed
    return routed + split.other


def delta_update_cost(split: ModelSplit, layouts: Sequence[ServerLayout], *, item_bytes: int, fraction: float,
                      nic_gb_s: float, senders: int, efficiency: float = BULK_EFFICIENCY) -> DeltaCost:
    """Bytes per inference GPU and seconds per update for both delivery shapes (module docstring)."""
    per_el = patch_bytes_per_element(fraction, item_bytes)
    rate = nic_gb_s * 1e9 * efficiency
    whole = split.trained * per_el
    ranks = [(rank_elements(split, lay) * per_el, lay.count * lay.tp) for lay in layouts]
    per_gpu = max((b for b, _ in ranks), default=0.0)
    total = sum(b * n for b, n in ranks)
    senders = max(1, senders)
    return DeltaCost(fraction=fraction, bytes_per_element=per_el, dense_bytes_per_gpu=split.trained * item_bytes,
                     whole_bytes_per_gpu=whole, whole_s=whole / rate, rank_bytes_per_gpu=per_gpu,
                     rank_total_bytes=total, rank_s=max(per_gpu / rate, total / (senders * rate)), senders=senders)


def server_layouts(cfg) -> list[ServerLayout]:
    """The SGLang servers of a RunConfig (unified workers, or prefill and decode servers)."""
    i = cfg.inference

    def one(count: int, lay) -> ServerLayout:
        sg = getattr(lay, "sglang", None)
        eplb = bool(getattr(sg, "enable_eplb", False))
        return ServerLayout(count=count, tp=lay.tp, ep=getattr(lay, "ep", 1) or 1,
                            dp_attention=getattr(lay, "dp_attention", 1) or 1,
                            redundant_experts=(getattr(sg, "ep_num_redundant_experts", 0) or 0) if eplb else 0)
    if i.num_workers:
        return [one(i.num_workers, i.worker)]
    return [one(n, lay) for n, lay in ((i.num_prefill_replicas, i.prefill), (i.num_decode_replicas, i.decode)) if n]


def model_split(model_cfg) -> ModelSplit:
    """Trained elements and the routed experts' share of them, from the model section (torch-free)."""
    from workers.models.facts import architecture

    a = architecture(model_cfg)
    routed = a.num_moe_layers * a.num_experts * a.expert_params() if a.is_moe else 0
    return ModelSplit(trained=float(a.params().total), routed=float(routed), num_experts=a.num_experts)
