"""Reshardable checkpoints of the FSDP and mesh plans through torch.distributed.checkpoint (DCP).

Why: the per-rank ``rank_R.pt`` files of workers/trainer/checkpoint.py hold each rank's shards
in that layout only, so a requeued job must get the same number of ranks. DCP stores every
tensor by its GLOBAL name, shape and the offsets of each shard; a load plans, per rank, which
slices of which files make up the shards of the NEW layout. So a run saved at dp 2 resumes at
dp 1 or 4, one saved at tp 2 x ep 2 (mesh plan) at dp 2 (FSDP plan), one at ep 4 at tp 2 x ep 2: experts are
stored by their HF per-expert names, each held by the ranks of its EP group
(``trainer.num_ranks`` and the layout may change between submissions of one run directory).

What (one directory ``step_N``): ``dcp/`` (DCP's files + ``.metadata``: model and AdamW state (under
LoRA the adapters, buffers and their AdamW state only: :func:`frozen_options`),
fully qualified by parameter name, through ``get_state_dict``; routed-expert stacks split into
per-expert views by :func:`per_expert_state`), ``rng_R.pt`` per saving rank
(torch, numpy, python RNG states), then ``COMPLETE`` {step, world_size, format: "dcp"}: the
step is the data position (batch N is ``rollouts/step_N``, re-sharded over the new ranks).

Protocol (COLLECTIVE, every rank, in step; deadlines: the process group's timeout):
  1. each rank writes ``rng_R.pt`` into ``.step_N.tmp/``;
  2. ``dcp.save``: DCP gathers the ranks' write plans on rank 0, each rank writes its shards,
     rank 0 writes ``.metadata`` once every rank reported its writes;
  3. rank 0 writes COMPLETE and renames the directory to ``step_N``; a barrier, so no rank
     looks at the directory before the rename.
A rank killed at any point leaves ``.step_N.tmp`` (ignored by readers) and the previous step.
Resume: RNG of the same rank if that rank saved, else rank 0's (a new rank has no own stream).
Signals (workers/trainer/checkpoint.py): after every step the ranks agree (:func:`agree`) on the
SIGUSR1 / SIGTERM flags, so one signalled rank saves and stops them all together; a SIGTERM
between steps stops WITHOUT a save when there are several ranks (peers may be elsewhere).
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from workers.common.atomic_dir import seal
from workers.common.protocol import COMPLETE
from workers.models.blocks.experts import checkpoint_named, stacked_state_names

FORMAT = "dcp"
DCP_DIR = "dcp"


def frozen_options(model):
    """LoRA (a frozen base, workers/models/lora): the checkpoint holds the trainable parameters (the
    adapters), buffers and their AdamW state only; the base is rebuilt from ``model.path`` / the
    seeded init on resume. None for a fully trained model (torch's defaults)."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def reshardable(model) -> bool:
    """True for models whose parameters are DTensors (the FSDP plan): they checkpoint through DCP."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def save(tmp: Path, final: Path, step: int, model, optimizer, *, rank: int, world_size: int) -> bool:
    """Write checkpoint ``step`` (COLLECTIVE, see the module docstring); True once ``final`` is complete."""
    tmp.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                       tmp / f"rng_{rank}.pt")
    model_sd, optim_sd = per_expert_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
    if rank == 0:
        seal(tmp, final, COMPLETE, {"step": step, "world_size": world_size, "format": FORMAT}, replace=False)
    _barrier()
    return (final / COMPLETE).exists()


def load(path: Path, model, optimizer, *, rank: int) -> None:
    """Restore model, AdamW state and RNG from ``path`` into this rank's shards (any saving world size)."""
    with stacked_state_names():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=frozen_options(model))  # this layout's shards
    # DCP fills the per-expert views in place, i.e. the stacks of model_sd / optim_sd.
    dcp.load(dict(zip(("model", "optim"), _split_experts(model, model_sd, optim_sd))), checkpoint_id=str(path / DCP_DIR))
    with stacked_state_names():
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=frozen_options(model))
    own = path / f"rng_{rank}.pt"
    rng = torch.load(own if own.exists() else path / "rng_0.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def per_expert_state(model, optimizer) -> tuple[dict, dict]:
    """torch's ``get_state_dict`` (model and optimizer state by parameter name, this rank's shards)
    with every routed-expert stack (workers/models/blocks/experts.py) split into per-expert views
    under checkpoint names (``...experts.7.gate_proj.weight``, global ids): the names DCP stores, so
    experts reshard between any ep / dp layouts and the files are those of per-expert models too."""
    with stacked_state_names():  # torch maps state-dict keys through named_parameters
        model_sd, optim_sd = get_state_dict(model, optimizer, options=frozen_options(model))
    return _split_experts(model, model_sd, optim_sd)


def _split_experts(model, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """Per-expert VIEWS of ``model_sd`` / ``optim_sd`` (nothing copied: a DCP load into them fills the stacks)."""
    model_out = checkpoint_named(model, model_sd)
    stacks = [n for n in model_sd if n not in model_out]
    if not stacks:
        return model_out, optim_sd
    names = {s: list(checkpoint_named(model, {s: model_sd[s]})) for s in stacks}
    state = dict(optim_sd.get("state", {}))
    moved = {s: state.pop(s) for s in stacks if s in state}
    tensors = {k for m in moved.values() for k, v in m.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    split = {k: checkpoint_named(model, {s: m[k] for s, m in moved.items()}) for k in tensors}
    for s, moments in moved.items():  # scalar entries (AdamW's step) are shared by the stack's experts
        state.update((n, {k: split[k][n] if k in tensors else v for k, v in moments.items()}) for n in names[s])
    groups = [{**g, "params": [m for p in g["params"] for m in names.get(p, [p])]}
              for g in optim_sd.get("param_groups", [])]
    return model_out, {**optim_sd, "state": state, "param_groups": groups}


def agree(*flags: bool) -> list[bool]:
    """Each flag true on every rank if it is true on any (COLLECTIVE: one all-reduce of max), so a
    signal that reached one rank makes every rank take the same collective save / stop."""
    t = torch.tensor([float(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def is_complete(d: Path, meta: dict) -> bool:
    """A DCP checkpoint is complete with its COMPLETE marker, DCP's ``.metadata`` and rank 0's RNG."""
    return meta.get("format") == FORMAT and (d / DCP_DIR / ".metadata").exists() and (d / "rng_0.pt").exists()


def _atomic_torch_save(obj, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
