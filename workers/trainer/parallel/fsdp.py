"""The generic sharding plan: FSDP2 over the data-parallel ranks, for ANY ``CausalLM``.

Used for every run with tp = ep = 1 (ModelSpec.trainer_plan picks the plan), whatever the
family: ``fully_shard`` each decoder layer of ``model.model.layers`` (every layer has its own
``forward(x, ctx)``, which FSDP2 needs to hook), then the root (embeddings, final norm, lm_head).
Each parameter becomes a DTensor sharded on dim 0 over the ``dp_shard`` mesh (routed-expert stacks
on their input dim: workers/models/blocks/experts.py): a rank holds 1/world of the parameters, of
their gradients and of the AdamW state.

Per layer, in the forward: all-gather the layer's shards (cast to the compute dtype by
``MixedPrecisionPolicy``), run it, free the gathered copy; in the backward: all-gather again,
backward, reduce-scatter the gradients in float32 into the float32 sharded gradients. Gradients
are SUMMED (divide factor 1), not averaged: the loss is already normalised by the GLOBAL token
count (workers/trainer/loss.py), as the mesh plan sums too. Unused
parameters (an expert no token of this rank chose) reduce-scatter zeros, so every rank runs the
same collectives.

The returned module is the family's own model (``fully_shard`` swaps its class in place), so its
forward, parameter names (the HF names) and ``config`` are unchanged; :class:`FsdpTrainerModel`
adds what the trainer's step and loop call on any plan: ``target_logprobs``, ``sync_grads``,
``clip_grad_norm_``, ``full_state_dict`` and ``full_grad_dict``.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from workers.models.blocks.experts import checkpoint_named, shard_placement
from workers.trainer.parallel.grad_clip import clip_sharded_grads_
from workers.common.dtensor import local_part
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.precision import Precision
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs


class FsdpTrainerModel:
    """Mixed into the fully-sharded model's class (see :func:`parallelize`): the trainer's interface."""

    dims: ParallelDims
    precision: Precision

    def target_logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                        temperature: float, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """log p and entropy of ``targets [N]`` under full-vocabulary ``logits [N, V]`` (FSDP keeps
        the whole vocabulary on every rank: no vocabulary-parallel reduction)."""
        return vocab_parallel_target_logprobs(logits, targets, temperature, vocab_start=0, group=None,
                                              entropy_grad=entropy_grad)

    def compute(self):
        """The forward's context: nothing (MixedPrecisionPolicy casts the gathered parameters)."""
        return contextlib.nullcontext()

    def sync_grads(self) -> None:
        """Nothing to do: the backward already reduce-scattered every gradient over ``dp``."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of the full gradient and clipping by ``torch.nn.utils.clip_grad_norm_``'s rule.

        Each rank sums the squares of its LOCAL shards (disjoint slices of every parameter, so
        nothing is counted twice); one all-reduce over the ranks gives the full model's norm.
        """
        return clip_sharded_grads_(list(self.parameters()), max_norm, reduce=self.dims.all_reduce)

    def full_state_dict(self, *, to_rank: Optional[int] = 0,
                        dtype: Optional[torch.dtype] = None) -> Optional[dict[str, torch.Tensor]]:
        """The full HF-named state dict (parameters and persistent buffers, e.g. a sigmoid router's
        correction bias), gathered one tensor at a time (``DTensor.full_tensor``: an all-gather per
        parameter, no second model is built), floating tensors cast to ``dtype`` when given.

        COLLECTIVE: every rank calls it, in step. Returned on ``to_rank`` (every rank with None).
        """
        return self._gather_full(self.state_dict().items(), to_rank, dtype)

    def full_grad_dict(self, *, to_rank: Optional[int] = 0) -> Optional[dict[str, torch.Tensor]]:
        """Like :meth:`full_state_dict` for the parameters' gradients (zeros where one has none), under
        the checkpoint names (expert stacks split per expert)."""
        grads = ((n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.named_parameters())
        full = self._gather_full(grads, to_rank, None)
        return None if full is None else checkpoint_named(self, full)

    @torch.no_grad()
    def _gather_full(self, tensors: Iterable[tuple[str, torch.Tensor]], to_rank: Optional[int],
                     dtype: Optional[torch.dtype]) -> Optional[dict[str, torch.Tensor]]:
        keep = to_rank is None or self.dims.rank == to_rank
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors:  # same order on every rank: the all-gathers pair up
            full = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach().clone()
            if keep:
                out[name] = full.to(dtype) if dtype is not None and full.is_floating_point() else full
        return out if keep else None


def reshard_between(mesh, i: int, num_layers: int) -> bool:
    """FSDP2's ``reshard_after_forward`` for layer ``i``: free the gathered (compute-dtype) weights
    between forward and backward, except for the last layer (needed again at once) and on a
    mesh of one rank, where "gathering" is a cast + copy per parameter (~1.7k launches per step
    for the 1.5B MoE's ~830 parameters in the H200 profile before experts were stacked; ~80 now)
    and keeping costs only the compute-dtype copy (2 bytes per parameter in bf16)."""
    return mesh.size() > 1 and i < num_layers - 1


def parallelize(full: nn.Module, dims: ParallelDims, *, precision: Optional[Precision] = None) -> nn.Module:
    """Shard ``full`` (a ``CausalLM`` in the MASTER dtype, identical on every rank) with FSDP2 over
    all trainer ranks; returns the same module, now an :class:`FsdpTrainerModel` too.

    ``precision`` None: compute in the parameters' dtype (no casts).
    """
    if dims.tp != 1 or dims.ep != 1:
        raise ValueError(f"the FSDP plan shards over data parallel only; tp({dims.tp}) x ep({dims.ep}) needs the "
                         f"mesh plan (workers/trainer/parallel/mesh.py)")
    # the trainable parameters' dtype (a LoRA model's frozen base stays in the compute dtype: workers/models/lora)
    master = next((p for p in full.parameters() if p.requires_grad), next(full.parameters())).dtype
    precision = precision or Precision(master=master, compute=master)
    assert precision.master == master, (precision, master)
    mesh = init_device_mesh(dims.device.type, (dims.world_size,), mesh_dim_names=("dp_shard",))
    policy = MixedPrecisionPolicy(param_dtype=None if not precision.mixed else precision.compute,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    layers = list(full.model.layers)
    for i, layer in enumerate(layers):
        # The last layer's gathered weights are needed again at once by the backward: keep them.
        fully_shard(layer, mesh=mesh, mp_policy=policy, shard_placement_fn=shard_placement(layer),
                    reshard_after_forward=reshard_between(mesh, i, len(layers)))
    fully_shard(full, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for module in [*layers, full]:
        if mesh.size() > 1:  # one rank sums already; FSDP2 would divide every gradient by the factor 1.0 there
            module.set_gradient_divide_factor(1.0)  # SUM: the loss carries the global normaliser
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        # torch >= 2.12. The H200 image's 2.11 lacks it: fine at world 1 (nothing to reduce-scatter);
        # with several ranks an expert unused on one rank could skip a collective there (untested on 2.11).
        if hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True)
    full.__class__ = type(f"Fsdp{type(full).__name__}", (FsdpTrainerModel, type(full)), {})
    full.dims, full.precision = dims, precision
    return full


def accumulate_unsharded(model: nn.Module, *, last: bool) -> None:
    """Before each micro-batch's backward (several per optimizer step): on a mesh of ONE rank, keep
    the compute-dtype copies FSDP2 made of the masters and the float32 gradients unreduced until the
    LAST micro-batch, which reduces and reshards as usual.

    Why: at world 1 FSDP2's "all-gather" is a cast of every master to bf16 and its "reduce-scatter"
    a copy of every gradient into the float32 sharded gradient; per micro-batch that is ~3 bytes
    read and written per parameter each way (1.9B parameters: ~10 ms a micro-batch on an H100)
    that nothing needs: the next micro-batch's forward reads the same weights, and FSDP2 accumulates
    unsynced gradients in its ``reduce_dtype`` (float32), so precision is unchanged. Several ranks
    keep syncing per micro-batch: deferring would hold a full, unsharded gradient per rank."""
    if not isinstance(model, FSDPModule) or model.dims.world_size != 1:
        return
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


@torch.no_grad()
def materialize(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> nn.Module:
    """Allocate a model sharded while on the meta device (either plan's ``parallelize`` of ``build(device="meta")``)
    and fill this rank's shards from ``tensors``: ``(name, FULL tensor or a callable reading it)``
    pairs taken one at a time (``CausalLM.seeded_tensors``, hf_checkpoint.checkpoint_tensors), so no
    rank ever holds more than one full tensor and a callable is called only for names it holds. Each DTensor
    shard is cut locally (``distribute_tensor(src_data_rank=None)``: no communication, any placement
    incl. FSDP's strided shards over TP); names this rank does not hold (other EP ranks' experts)
    are skipped. Every parameter and persistent buffer must come by (checked)."""
    model.to_empty(device=device)
    state = model.state_dict(keep_vars=True)
    missing = set(state)
    for name, full in tensors:
        t = state.get(name)
        if t is None:
            continue
        full = (full() if callable(full) else full).to(device=device, dtype=t.dtype)
        if isinstance(t, DTensor):
            t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())
        else:
            t.copy_(full)
        missing.discard(name)
    if missing:
        raise ValueError(f"materialize: no values for {sorted(missing)[:8]} ({len(missing)} tensors)")
    return model


def unsharded(full: nn.Module, dims: ParallelDims) -> nn.Module:
    """The trainer's interface (:class:`FsdpTrainerModel`) on the plain model, nothing sharded and no
    process group: one-process scoring and steps in unit tests and benchmarks (the trainer itself
    always runs a plan). Compute runs in the parameters' dtype."""
    assert dims.world_size == 1 and dims.tp == dims.ep == 1, dims
    master = next(full.parameters()).dtype
    full.__class__ = type(f"Unsharded{type(full).__name__}", (FsdpTrainerModel, type(full)), {})
    full.dims, full.precision = dims, Precision(master=master, compute=master)
    return full




def sharded_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    total = 0
    for p in module.parameters():
        total += local_part(p).numel() * local_part(p).element_size()
        if p.grad is not None:
            total += local_part(p.grad).numel() * local_part(p.grad).element_size()
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    total += local_part(v).numel() * local_part(v).element_size()
    return total

