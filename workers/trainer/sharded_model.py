"""The trainer's model: a GQA + SwiGLU/MoE decoder with its modules swapped for TP / EP shards, HF names kept.

This is the tensor/expert-parallel plan (``ModelSpec.parallelize``) of the families built from the
pre-norm decoder layer (workers/models/blocks/layer.py): ``tiny_moe``, the dense ``llama`` and
``qwen3_moe`` (dense and MoE layers mixed; per-head q/k norms), used when trainer.parallel.tp or
ep > 1; runs with tp = ep = 1 use the generic FSDP2 plan (workers/trainer/fsdp.py). With float32
master weights and a bfloat16 trainer.dtype the forward runs under autocast
(workers/trainer/precision.py).

Built from the full seeded model (every rank builds it, then keeps its slices), so any
(tp, ep, dp) starts from bit-identical weights. ``CausalLM.forward`` runs unchanged: only
``self_attn``, ``mlp`` and ``lm_head`` are replaced by their parallel versions
(tensor_parallel.py, expert_parallel.py); each layer keeps its ``routed`` flag.
``named_parameters()`` yields the HF names with LOCAL shapes;
:meth:`ShardedMoeForCausalLM.full_state_dict` gathers the full HF state dict for weight publishing.

Placement of each parameter (what its gradient sums over, and how it is gathered):
  ``replicated`` embed_tokens, norms, router gates: identical on all tp x ep ranks (per-head
                 q/k norms get a TP-summed gradient: tensor_parallel.HeadSharedNorm);
  ``tp``         q/k/v (rows), o_proj (columns), lm_head (vocab rows, padded): split over TP;
  ``expert``     expert MLPs: owned by one EP rank, split over TP (gate/up rows, down columns).
Dense (replicated + tp) gradients sum over the ``batch`` group, expert gradients over ``dp``
(the replicas of that expert); the global norm sums each shard once over ``mp``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from workers.models.blocks.decoder import CausalLM
from workers.trainer.expert_parallel import ExpertParallelMoeBlock
from workers.trainer.parallel import ParallelDims
from workers.trainer.precision import Precision, autocast
from workers.trainer.tensor_parallel import (TensorParallelAttention, TensorParallelMlp, VocabParallelHead,
                                             vocab_parallel_target_logprobs)

#: parameter-name suffix -> dim split over TP (absent: replicated over TP)
_TP_DIM = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1, "lm_head.weight": 0,
           "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class ShardedMoeForCausalLM(CausalLM):
    """This rank's shard of a full model (TinyMoeForCausalLM, Qwen3MoeForCausalLM) under ``dims``
    (see the module docstring)."""

    def __init__(self, full: CausalLM, dims: ParallelDims, *, precision: Optional[Precision] = None):
        super().__init__()
        self.config, self.dims, self.precision = full.config, dims, precision
        self.full_type = type(full)  # what full_state_dict's names and shapes are those of
        tp_group, ep_group = dims.get_group("tp"), dims.get_group("ep")
        self.model = full.model
        if dims.cp != 1:  # the plan refuses it first (launcher/resources.py check_context_parallel)
            raise ValueError(f"trainer.parallel.cp({dims.cp}): context parallelism runs in the FSDP plan only, "
                             f"not with tp({dims.tp}) x ep({dims.ep})")
        if full.num_routed_layers == 0 and dims.ep > 1:
            raise ValueError(f"expert parallel ep({dims.ep}) > 1 needs a MoE model; model.num_experts=0 is dense")
        for layer in self.model.layers:
            layer.self_attn = TensorParallelAttention(layer.self_attn, tp_group, dims.tp_rank, dims.tp)
            if not layer.routed:
                layer.mlp = TensorParallelMlp(layer.mlp, tp_group, dims.tp_rank, dims.tp)
            else:
                layer.mlp = ExpertParallelMoeBlock(layer.mlp, ep_group=ep_group, ep=dims.ep, ep_rank=dims.ep_rank,
                                                   tp_group=tp_group, tp=dims.tp, tp_rank=dims.tp_rank)
        # Tied embeddings: the replicated embedding gives every TP rank the full logits, so the
        # log-probs need no vocabulary-parallel reduction (target_logprobs passes no group).
        self.lm_head = None if full.lm_head is None else VocabParallelHead(full.lm_head, tp_group, dims.tp_rank, dims.tp)
        self.placement = {name: placement(name) for name, _ in self.named_parameters()}

    def compute(self):
        """The forward's context: autocast to the compute dtype over master-dtype parameters
        (workers/trainer/precision.py); nothing when they are one dtype."""
        return autocast(self.dims.device, self.precision)

    # -- scoring ---------------------------------------------------------------------
    def target_logprobs(self, local_logits: torch.Tensor, targets: torch.Tensor,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """log p and entropy of ``targets [N]`` under logits ``[N, V_local]`` computed only at the
        positions the loss needs (forward's ``logits_mask``)."""
        start, group = (0, None) if self.lm_head is None else (self.lm_head.vocab_start, self.dims.get_group("tp"))
        return vocab_parallel_target_logprobs(local_logits, targets, temperature, vocab_start=start, group=group)

    # -- gradients ---------------------------------------------------------------------
    def sync_grads(self) -> None:
        """Dense gradients summed over ``batch``, expert gradients over ``dp`` (module doc)."""
        dense = [p for n, p in self.named_parameters() if self.placement[n] != "expert"]
        experts = [p for n, p in self.named_parameters() if self.placement[n] == "expert"]
        self.dims.all_reduce_grads(dense, group="batch")
        self.dims.all_reduce_grads(experts, group="dp")

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of the FULL model's gradient (each shard counted once) and clipping,
        with ``torch.nn.utils.clip_grad_norm_``'s rule; returns the pre-clip norm."""
        repl = {"replicated": self.dims.tp * self.dims.ep, "tp": self.dims.ep, "expert": 1}
        sq = torch.zeros((), dtype=torch.float64, device=self.dims.device)
        for n, p in self.named_parameters():
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum() / repl[self.placement[n]]
        norm = float(self.dims.all_reduce(sq, group="mp").sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(max_norm) else 1.0
        if coef < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    # -- full HF state dict ------------------------------------------------------------
    def full_state_dict(self, *, to_rank: Optional[int] = 0,
                        dtype: Optional[torch.dtype] = None) -> Optional[dict[str, torch.Tensor]]:
        """The full model's HF-named state dict, gathered from the shards (detached copies).

        COLLECTIVE: every trainer rank must call it, in step. Returns the dict on global rank
        ``to_rank`` (on every rank with ``to_rank=None``) and None elsewhere. Keys and shapes
        are exactly the full model's ``state_dict()``'s; the vocabulary padding of
        the TP lm_head is cut off. ``dtype``: cast each tensor (publishing in the compute dtype).
        """
        get = (lambda p: p.detach()) if dtype is None else (lambda p: p.detach().to(dtype))
        return self._gather_full(get, to_rank)

    def full_grad_dict(self, *, to_rank: Optional[int] = 0) -> Optional[dict[str, torch.Tensor]]:
        """Like :meth:`full_state_dict` for the (synced) gradients; missing ones are zeros."""
        return self._gather_full(lambda p: p.grad if p.grad is not None else torch.zeros_like(p), to_rank)

    @torch.no_grad()
    def _gather_full(self, get: Callable[[nn.Parameter], torch.Tensor],
                     to_rank: Optional[int]) -> Optional[dict[str, torch.Tensor]]:
        tp_group, ep_group = self.dims.get_group("tp"), self.dims.get_group("ep")
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():  # same order on every rank: collectives pair up
            if self.placement[name] == "tp":
                out[name] = _gather(get(p), _TP_DIM[_suffix(name)], tp_group)
            elif self.placement[name] == "replicated":
                out[name] = get(p).clone()
        if "lm_head.weight" in out:
            out["lm_head.weight"] = out["lm_head.weight"][: self.config.vocab_size]
        for i, layer in enumerate(self.model.layers):
            if not layer.routed:
                continue
            keys = list(layer.mlp.experts.keys())  # this rank's global expert ids, ascending
            for proj in EXPERT_PROJS:
                stack = torch.stack([get(getattr(layer.mlp.experts[k], proj).weight) for k in keys])
                stack = _gather(stack, 1 + _TP_DIM[proj + ".weight"], tp_group)  # [E_local, out, in]
                every = _gather(stack, 0, ep_group)  # [E, out, in]: EP ranks own ascending blocks
                for e in range(every.shape[0]):
                    out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = every[e].clone()
        if to_rank is not None and self.dims.rank != to_rank:
            return None
        return {k: out[k] for k in _full_names(self)}


class FullWeights:
    """What ``loop.publish_weights`` needs of a model: ``state_dict()`` of FULL HF tensors.

    Wraps the result of :meth:`ShardedMoeForCausalLM.full_state_dict` (None on ranks that
    do not publish) so the publisher's signature stays ``(paths, version, model, ...)``.
    """

    def __init__(self, state: Optional[dict[str, torch.Tensor]]):
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        assert self._state is not None, "full weights exist only on the gathering rank"
        return self._state


def placement(name: str) -> str:
    """``replicated`` | ``tp`` | ``expert`` for an HF parameter name of the decoder."""
    if ".mlp.experts." in name:
        return "expert"
    return "tp" if _suffix(name) in _TP_DIM else "replicated"


def _suffix(name: str) -> str:
    return ".".join(name.split(".")[-2:])


def _full_names(model: ShardedMoeForCausalLM) -> list[str]:
    with torch.device("meta"):
        return list(model.full_type(model.config).state_dict().keys())


def _gather(t: torch.Tensor, dim: Optional[int], group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Concatenate ``t`` of every rank of ``group`` along ``dim`` (a copy; no-op without a group)."""
    if group is None or dim is None:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
