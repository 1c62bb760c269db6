"""The mesh plan: FSDP2 + DTensor tensor parallel + expert parallel on ONE DeviceMesh, for any
``CausalLM`` built from the shared blocks (tiny_moe, llama, qwen3_moe, deepseek_v3, glm_moe_dsa,
nemotron_h). ``ModelSpec.trainer_plan`` picks it whenever trainer.parallel.tp or ep > 1.

The mesh (:func:`build_mesh`) has dimensions ``(ep, dp_shard, cp, tp)`` over the ranks of
workers/trainer/parallel/dims.py's layout (rank = ((dp * ep + ep_rank) * cp + cp_rank) * tp + tp_rank,
TP innermost), and two flattened views: ``batch`` = ep x dp_shard x cp (every rank with distinct
tokens: dense parameters are fully_shard-ed over it) and ``edp`` = dp_shard x cp x tp (the ranks
holding the same experts: the expert-data-parallel dimension the experts are fully_shard-ed over).
dp_replicate (HSDP) is not a dimension yet: every data-parallel rank shards.

Context parallel (``cp`` > 1, workers/trainer/parallel/context.py): the cp ranks of a group hold
the same rows and each runs a contiguous chunk of every row. Nothing in the model changes for it:
attention splits its heads over tp first, then Ulysses swaps sequence for heads over the cp group
on the heads left (workers/models/blocks/ulysses.py; with fewer local heads than cp it gathers the
keys and values instead); routers, Router Replay and the EP all-to-all see this cp rank's tokens
only (routing is per position); the Mamba-2 scan (replicated over tp) splits its heads over cp.
Each cp rank's loss is its tokens' share of the globally normalised loss, so FSDP's gradient sum
over ``batch`` / ``edp`` (which include cp) adds the cp ranks' contributions.

Per decoder layer, in this order (tensor parallel first, FSDP wraps the DTensors last):
  attention  GQA: q/k/v ColwiseParallel (heads split, with their biases), o_proj RowwiseParallel (its
             bias replicated), per-head q/k norms replicated with a TP-summed gradient, attention
             sinks (one logit per head) sharded with the heads; MLA: q_b_proj (or q_proj) and kv_b_proj
             ColwiseParallel (split by heads), o_proj RowwiseParallel, the latent down-projections
             (q_a_proj, kv_a_proj_with_mqa), their norms and a DSA indexer replicated; Mamba-2
             mixers stay replicated (no TP split of their fused in_proj yet);
  dense MLP  SwiGLU / squared-ReLU (and a MoE block's shared experts): gate/up Colwise, down Rowwise;
  MoE        experts split over ep (workers/trainer/parallel/expert.py), router replicated;
  vocab      embed_tokens RowwiseParallel (vocab-parallel lookup), lm_head ColwiseParallel with
             its output left vocab-sharded: :meth:`MeshTrainerModel.target_logprobs` computes the
             log-probs vocab-parallel (workers/trainer/parallel/tensor.py), never [T, V]. Tied
             embeddings stay replicated (the head is the embedding).
Then ``fully_shard`` of each MoE block's experts over ``edp``, of every layer over ``batch`` and
of the root. Gradients are summed (divide factor 1): the loss carries the global normaliser.
Expert stacks are sharded on their input dim (experts.SHARD_DIM), so each expert's checkpoint-named
view (by global id) is a slice of the local shard: DCP checkpoints (workers/trainer/dcp_state.py)
store experts per expert and reshard between this plan and the FSDP plan at any layout.
"""
from __future__ import annotations

import functools
import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workers.models.blocks.experts import StackedExperts, checkpoint_named, shard_placement, stacked_state_names
from workers.trainer.parallel.expert import shard_experts
from workers.trainer.parallel.fsdp import FsdpTrainerModel, materialize, reshard_between  # noqa: F401  (materialize: shared with the FSDP plan)
from workers.trainer.parallel.grad_clip import clip_sharded_grads_
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.precision import Precision
from workers.trainer.parallel.tensor import HeadSharedNorm, copy_to, vocab_parallel_target_logprobs

COL, ROW = ColwiseParallel(), RowwiseParallel()


def build_mesh(dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(mesh (ep, dp_shard, cp, tp), batch view, edp view). COLLECTIVE (creates the groups).

    The cp ranks of a group hold the same parameters and different tokens of the same rows, so
    they are one more data-parallel dimension to FSDP: dense parameters shard over ep x dp_shard x
    cp (``batch``, torchtitan's dp_shard_cp), experts over dp_shard x cp x tp (``edp``)."""
    ranks = torch.arange(dims.world_size).view(dims.dp, dims.ep, dims.cp, dims.tp).permute(1, 0, 2, 3)
    mesh = DeviceMesh(dims.device.type, ranks, mesh_dim_names=("ep", "dp_shard", "cp", "tp"))
    return mesh, mesh["ep", "dp_shard", "cp"]._flatten("batch"), mesh["dp_shard", "cp", "tp"]._flatten("edp")


def _is_moe(m: nn.Module) -> bool:
    return hasattr(m, "experts") and hasattr(m, "num_experts") and callable(getattr(m, "routed_experts", None))


def _tp_attention(attn: nn.Module, tp_mesh: DeviceMesh, tp: int) -> None:
    """GQA (Attention, NoPEAttention) or MLA (anything with kv_b_proj): heads split over tp."""
    if hasattr(attn, "kv_b_proj"):  # MLA: only the per-head up-projections and o_proj are split
        up = "q_b_proj" if getattr(attn, "q_lora_rank", 0) else "q_proj"
        plan = {up: COL, "kv_b_proj": COL, "o_proj": ROW}
        # The rope key is one head shared by every query head: its gradient sums over the TP ranks.
        attn.__dict__["tp_shared"] = functools.partial(copy_to, group=tp_mesh.get_group())
    else:
        if attn.nkv % tp:
            raise ValueError(f"trainer.parallel.tp({tp}) must divide the KV heads({attn.nkv})")
        plan = {"q_proj": COL, "k_proj": COL, "v_proj": COL, "o_proj": ROW}
        attn.nkv //= tp
    if attn.nh % tp:
        raise ValueError(f"trainer.parallel.tp({tp}) must divide the attention heads({attn.nh})")
    attn.nh //= tp
    parallelize_module(attn, tp_mesh, plan)  # q/k/v biases split with their heads; o_proj's stays replicated
    if getattr(attn, "sinks", None) is not None:  # one sink logit per query head: split with the heads
        attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))
    for norm in ("q_norm", "k_norm"):  # per-head norms on the local heads: gradient summed over tp
        if getattr(attn, norm, None) is not None:
            setattr(attn, norm, HeadSharedNorm(getattr(attn, norm), tp_mesh.get_group()))


def _tp_mlp(mlp: nn.Module, tp_mesh: DeviceMesh) -> None:
    plan = {"up_proj": COL, "down_proj": ROW}
    if hasattr(mlp, "gate_proj"):
        plan["gate_proj"] = COL
    parallelize_module(mlp, tp_mesh, plan)


def _apply_tp(full: nn.Module, tp_mesh: DeviceMesh, tp: int) -> bool:
    """Tensor-parallelise ``full`` in place; True when lm_head is vocab-sharded."""
    for layer in full.model.layers:
        for m in list(layer.modules()):
            if _is_moe(m):
                if getattr(m, "shared_experts", None) is not None:
                    _tp_mlp(m.shared_experts, tp_mesh)
            elif hasattr(m, "o_proj") and hasattr(m, "nh"):
                _tp_attention(m, tp_mesh, tp)
        mlp = getattr(layer, "mlp", None) or getattr(layer, "mixer", None)
        if mlp is not None and not _is_moe(mlp) and hasattr(mlp, "down_proj") and hasattr(mlp, "up_proj"):
            _tp_mlp(mlp, tp_mesh)
    if full.lm_head is None:
        return False  # tied: the embedding is the head and stays replicated
    parallelize_module(full.model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                         output_layouts=Replicate()))
    parallelize_module(full.lm_head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=True))
    return True


class MeshTrainerModel(FsdpTrainerModel):
    """The trainer's interface on the mesh plan (see :class:`FsdpTrainerModel` for the FSDP-only one)."""

    vocab_sharded: bool
    mesh: DeviceMesh
    """The plan's mesh: its tp and ep groups carry every TP / EP collective of the model (the step's
    batch statistics go over ParallelDims' ``batch`` group, the same ranks as the mesh's)."""
    full_param_names: list[str]
    full_state_names: list[str]

    def target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                        temperature: float, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """log p / entropy from this TP rank's vocabulary slice ``[N, ceil(V/tp)]`` (the last rank's
        may be shorter): three ``[N]`` all-reduces over tp, no full logits."""
        if not self.vocab_sharded:
            return super().target_logprobs(logits, targets, temperature, entropy_grad)
        start = self.dims.tp_rank * -(-self.config.vocab_size // self.dims.tp)
        return vocab_parallel_target_logprobs(logits, targets, temperature, vocab_start=start,
                                              group=self.mesh.get_group("tp"), entropy_grad=entropy_grad)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm with each element counted once: a rank's local shard of a parameter is
        held by ``holders / shards`` ranks (holders: every rank, or the ``world / ep`` ranks of
        an expert's EP rank; shards: the product of the sharded dims of its mesh)."""
        experts = {id(p) for _, m in self.expert_modules() for p in m.parameters()}
        world, ep = self.dims.world_size, self.dims.ep

        def weight(p: nn.Parameter) -> float:
            holders = world // (ep if id(p) in experts else 1)
            g = p.grad  # not is_shard(): FSDP over a TP-sharded dim uses _StridedShard (is_shard() False)
            shards = (math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
                      if isinstance(g, DTensor) else 1)
            return shards / holders
        return clip_sharded_grads_(list(self.parameters()), max_norm, weight=weight,
                                   reduce=dist.all_reduce if world > 1 else (lambda t: t))

    def full_state_dict(self, *, to_rank: Optional[int] = 0,
                        dtype: Optional[torch.dtype] = None) -> Optional[dict[str, torch.Tensor]]:
        """The full HF state dict (COLLECTIVE): DTensors gathered one at a time, each expert stack
        gathered over edp then ep (all_gather of the local experts), then split per expert."""
        with stacked_state_names():
            state = self.state_dict()
        return self._gather_all(state.items(), self.full_state_names, to_rank, dtype)

    def full_grad_dict(self, *, to_rank: Optional[int] = 0) -> Optional[dict[str, torch.Tensor]]:
        """The full gradients under checkpoint names (as :meth:`full_state_dict`'s, buffers aside)."""
        grads = ((n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.named_parameters())
        return self._gather_all(grads, self.full_param_names, to_rank, None)

    @torch.no_grad()
    def _gather_all(self, tensors: Iterable[tuple[str, torch.Tensor]], names: list[str], to_rank: Optional[int],
                    dtype: Optional[torch.dtype]) -> Optional[dict[str, torch.Tensor]]:
        tensors = dict(tensors)
        local = self.expert_modules()
        prefixes = tuple(prefix + "." for prefix, _ in local)
        dense = [(n, t) for n, t in tensors.items() if not n.startswith(prefixes)]
        out = self._gather_full(dense, None, dtype)
        ep_group = self.mesh.get_group("ep") if self.dims.ep > 1 else None
        for prefix, experts in local:  # same order on every rank
            stacks = {}
            for s in experts.stacks():
                t = tensors[f"{prefix}.{s}"]
                stack = t.full_tensor() if isinstance(t, DTensor) else t.detach()
                if ep_group is not None:
                    parts = [torch.empty_like(stack) for _ in range(self.dims.ep)]
                    dist.all_gather(parts, stack.contiguous(), group=ep_group)
                    stack = torch.cat(parts)
                stacks[s] = stack.to(dtype) if dtype is not None and stack.is_floating_point() else stack
            out.update((f"{prefix}.{n}", t) for n, t in experts.split(stacks, first=0))
        if to_rank is not None and self.dims.rank != to_rank:
            return None
        return {n: out[n] for n in names}

    def expert_modules(self) -> list[tuple[str, StackedExperts]]:
        """(name, module) of every MoE block's (local) expert stacks."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, StackedExperts)]


def parallelize(full: nn.Module, dims: ParallelDims, *, precision: Optional[Precision] = None) -> nn.Module:
    """Shard ``full`` (a ``CausalLM`` in the MASTER dtype, identical on every rank) over the mesh
    of ``dims`` (module docstring); returns the same module, now a :class:`MeshTrainerModel`."""
    master = next(full.parameters()).dtype
    precision = precision or Precision(master=master, compute=master)
    assert precision.master == master, (precision, master)
    param_names = list(checkpoint_named(full, dict(full.named_parameters())))  # checkpoint names
    state_names = list(full.state_dict().keys())
    if dims.ep > 1 and not any(_is_moe(m) for m in full.modules()):
        raise ValueError(f"trainer.parallel.ep({dims.ep}) > 1 needs a MoE model; this one has no routed layers")
    mesh, batch_mesh, edp_mesh = build_mesh(dims)
    vocab_sharded = _apply_tp(full, mesh["tp"], dims.tp) if dims.tp > 1 else False
    policy = MixedPrecisionPolicy(param_dtype=None if not precision.mixed else precision.compute,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    units = []
    layers = list(full.model.layers)
    for i, layer in enumerate(layers):
        for block in [m for m in layer.modules() if _is_moe(m)]:
            experts = shard_experts(block, ep_group=mesh.get_group("ep") if dims.ep > 1 else None, ep=dims.ep,
                                    ep_rank=dims.ep_rank, tp_group=mesh.get_group("tp") if dims.tp > 1 else None,
                                    tp=dims.tp, tp_rank=dims.tp_rank, ep_mesh=mesh["ep"])
            fully_shard(experts, mesh=edp_mesh, mp_policy=policy, shard_placement_fn=shard_placement(experts),
                        reshard_after_forward=reshard_between(edp_mesh, i, len(layers)))
            units.append(experts)
        fully_shard(layer, mesh=batch_mesh, mp_policy=policy, shard_placement_fn=shard_placement(layer),
                    reshard_after_forward=reshard_between(batch_mesh, i, len(layers)))
        units.append(layer)
    fully_shard(full, mesh=batch_mesh, mp_policy=policy, reshard_after_forward=False)
    for module in [*units, full]:
        module.set_gradient_divide_factor(1.0)  # SUM: the loss carries the global normaliser
        module.set_force_sum_reduction_for_comms(True)
        if hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True)
    full.__class__ = type(f"Mesh{type(full).__name__}", (MeshTrainerModel, type(full)), {})
    full.dims, full.precision, full.vocab_sharded = dims, precision, vocab_sharded
    full.full_param_names, full.full_state_names = param_names, state_names
    full.mesh = mesh
    return full
