"""workers/trainer/parallel/ is one floor below the step: the step and the loop import it, it
imports from the rest of the trainer only what a plan takes as input.

Why: the package exists so that a parallelism can change without touching the step, and the step
without touching the plans; one import from parallel/ back up into step.py or loop.py (a
``TYPE_CHECKING`` one included) would tie them into one knot again. Edges come from the repo's
import-graph reader (tests/unit/repo/test_import_graph.py: lazy and type-only imports counted).
"""
from __future__ import annotations

from tests.unit.repo.test_import_graph import cycles, graph

PACKAGE = "workers.trainer.parallel"
#: What the plans take from the rest of the trainer: the rollout batch a CP rank chunks, and the
#: dtypes the FSDP2 mixed-precision policy casts to. Neither imports parallel/.
MAY_IMPORT = {"workers.trainer.batch", "workers.trainer.precision"}


def collapse(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The trainer's import graph with every module of parallel/ as one node."""
    def node(m: str) -> str:
        return PACKAGE if m == PACKAGE or m.startswith(PACKAGE + ".") else m

    out: dict[str, set[str]] = {}
    for name, deps in edges.items():
        if name.startswith("workers.trainer"):
            out.setdefault(node(name), set()).update(node(d) for d in deps if d.startswith("workers.trainer"))
    return {k: v - {k} for k, v in out.items()}


def test_collapse_finds_a_cycle_through_the_package():
    edges = {"workers.trainer.step": {"workers.trainer.parallel.fsdp"},
             "workers.trainer.parallel.mesh": {"workers.trainer.step", "workers.trainer.parallel.fsdp"}}
    assert cycles(collapse(edges)) == [["workers.trainer.parallel", "workers.trainer.step"]]


def test_parallel_imports_only_the_plans_inputs_from_the_trainer():
    edges = graph()
    assert any(m.startswith(PACKAGE + ".") for m in edges), "workers/trainer/parallel/ not found"
    up = sorted((name, d) for name, deps in edges.items() if name.startswith(PACKAGE + ".")
                for d in deps if d.startswith("workers.trainer") and not d.startswith(PACKAGE) and d not in MAY_IMPORT)
    assert not up, f"parallel/ imports trainer code above it: {up}"


def test_the_package_is_no_part_of_a_cycle():
    found = cycles(collapse(graph()))
    assert not found, f"cycles through workers/trainer/parallel/ as one node: {found}"
