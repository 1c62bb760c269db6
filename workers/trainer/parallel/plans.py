"""The trainer's sharding plans, by name: the table a model family's ``ModelSpec.parallelize`` names into.

Why a table owned by the trainer: the plans are trainer code (FSDP2, DTensor TP, EP, CP), so the
trainer says where they live; a family only declares, by name, which plan its tensor/expert-parallel
runs use (``ModelSpec.parallelize``, default ``"mesh"``), and ``ModelSpec.trainer_plan`` picks the
name for a run (plan time and every trainer rank agree). Nothing under workers/models names a
trainer module. The table holds the functions themselves, so an editor follows a name to its plan
and a renamed plan function fails when this module is imported, not when a run first asks for it
(the trainer imports both plans anyway; the launcher never imports this module).

    "fsdp"  workers/trainer/parallel/fsdp.py  FSDP2 over all trainer ranks, any CausalLM (tp = ep = 1)
    "mesh"  workers/trainer/parallel/mesh.py  FSDP2 + DTensor TP + EP (+ CP) on one DeviceMesh, any
                                              CausalLM of the shared blocks (tp or ep > 1)

Every plan is ``parallelize(full_model, dims, *, precision) -> this rank's shard``.
"""
from __future__ import annotations

from typing import Any

from workers.models.spec import FSDP_PLAN, MESH_PLAN
from workers.trainer.parallel import fsdp, mesh

PLANS = {FSDP_PLAN: fsdp.parallelize, MESH_PLAN: mesh.parallelize}


def plan_function(name: str):
    """The ``parallelize`` of the plan called ``name``; ValueError listing the plans for another name."""
    if name not in PLANS:
        raise ValueError(f"no trainer plan {name!r} (ModelSpec.parallelize); the trainer has {sorted(PLANS)}")
    return PLANS[name]


def shard(spec, full: Any, dims, *, precision=None):
    """This rank's shard of ``full`` under the plan ``spec`` picks for ``dims`` (what every trainer rank runs)."""
    return plan_function(spec.trainer_plan(dims.tp, dims.ep))(full, dims, precision=precision)
