"""The trainer's plan table holds the plan functions themselves (workers/trainer/parallel/plans.py).

Why: with ``"module:function"`` strings a renamed plan function was found only when a run first
sharded its model, on the cluster; with the functions in the table it fails at import, in CI.
"""
from __future__ import annotations

import importlib

import pytest

from workers.models.spec import FSDP_PLAN, MESH_PLAN
from workers.trainer.parallel import fsdp, mesh, plans


def test_the_table_names_the_plan_functions():
    assert plans.plan_function(FSDP_PLAN) is fsdp.parallelize
    assert plans.plan_function(MESH_PLAN) is mesh.parallelize
    with pytest.raises(ValueError, match="no trainer plan 'ring'"):
        plans.plan_function("ring")


def test_a_renamed_plan_function_fails_at_import(monkeypatch):
    monkeypatch.delattr(mesh, "parallelize")  # as if it had been renamed
    try:
        with pytest.raises(AttributeError, match="parallelize"):
            importlib.reload(plans)
    finally:
        monkeypatch.undo()
        importlib.reload(plans)
    assert plans.plan_function(MESH_PLAN) is mesh.parallelize
