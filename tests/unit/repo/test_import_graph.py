"""The import graph of launcher/ and workers/: no cycles, and the launcher reaches roles only through registries.

Why a test: cycles crept in three times (an interface module holding its factory, a server and its
routes importing each other's private helpers, a report module and the bandwidth judge), and each
one made an import order matter. Edges are read from the source (ast), lazy imports inside
functions and ``if TYPE_CHECKING:`` blocks included: a type-only cycle never breaks an import,
but it still ties two modules into one that neither a reader nor a move can take apart.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("launcher", "workers")
#: What launcher/ may import from workers/: the common protocols/configs/registries (which reach
#: the plugin homes by name), each axis's pure spec interface, and the pure preflight limits.
#: Never a role's code, never a plugin home directly. ``workers.models.pretrained`` is the table of
#: checkpoint sources the launcher converts once on the login node (torch-free); ``workers.models.hf_dir``
#: reads a ``model.path`` checkpoint directory's JSON files (config.json, index, tokenizer) torch-free;
#: ``workers.models.weight_integrity`` checks its safetensors files whole and finite, torch-free (a teacher).
LAUNCHER_MAY_IMPORT = ("workers.common", "workers.preflight.limits", "workers.models.spec", "workers.weights.spec",
                       "workers.inference.spec", "workers.orchestrator.envs.spec", "workers.models.pretrained",
                       "workers.models.hf_dir", "workers.models.weight_integrity")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of this repo that ``name`` imports (a ``from pkg import sub`` counts as ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = name.split(".") if is_pkg else name.split(".")[:-1]
                    parent = parent[: len(parent) - (child.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in modules else base)
            visit(child)

    visit(tree)
    return {m for m in out if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_edges(tmp_path):
    """An import only a type checker runs still ties the two modules (module docstring)."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    edges = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert edges == {"a": {"b"}, "b": {"a"}}
    assert cycles(edges) == [["a", "b"]]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles (break each by moving the shared part to its own module):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_launcher_reaches_roles_only_through_registries():
    bad = sorted((name, dep) for name, deps in graph().items() if name.startswith("launcher")
                 for dep in deps if dep.startswith("workers") and not dep.startswith(LAUNCHER_MAY_IMPORT))
    assert not bad, f"launcher imports role internals: {bad}"


ROLES = ("workers.trainer", "workers.inference", "workers.orchestrator", "workers.weights", "workers.preflight",
         "workers.models")


def test_common_imports_no_role():
    """workers/common is what every role shares (config, topology, protocol, registries): importing a
    role or plugin home from it would load that role's code into every other role."""
    bad = sorted((name, dep) for name, deps in graph().items() if name.startswith("workers.common")
                 for dep in deps if dep.startswith(ROLES))
    assert not bad, f"workers/common imports role code: {bad}"


#: The processes of a run. Each imports what every role shares and its own package only: a role
#: importing another role's module loads that role's code (and its torch, NVML, HTTP stack) into a
#: process that never runs it, and ties two packages that change for different reasons.
PROCESS_ROLES = ("orchestrator", "trainer", "inference", "preflight", "router")
#: What every role may import: below the roles (models and weights import no role either).
SHARED = ("common", "models", "weights")


def role_crossings(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs of workers/ where a role imports another role, or a shared
    package imports a role."""
    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if parts[0] == "workers" and len(parts) > 1 else ""

    bad = []
    for name, deps in edges.items():
        own = package(name)
        if own not in PROCESS_ROLES + SHARED:
            continue
        bad += [(name, d) for d in deps if package(d) in PROCESS_ROLES and package(d) != own]
    return sorted(bad)


def test_role_crossing_finder_finds_one():
    edges = {"workers.orchestrator.a": {"workers.trainer.b", "workers.common.c", "workers.orchestrator.d"},
             "workers.weights.e": {"workers.inference.f", "workers.models.g"}, "workers.trainer.b": {"workers.weights.e"}}
    assert role_crossings(edges) == [("workers.orchestrator.a", "workers.trainer.b"),
                                     ("workers.weights.e", "workers.inference.f")]


def test_roles_import_only_shared_code_and_their_own():
    bad = role_crossings(graph())
    assert not bad, "a role imports another role (move the shared piece to workers/common or workers/models):\n" + \
        "\n".join(f"{a} -> {b}" for a, b in bad)


def test_benchmarks_and_tools_never_import_tests():
    """Benchmarks and tools run where tests/ is not installed (the GPU machine): they import the
    project, never the test tree."""
    bad = []
    for pkg in ("benchmarks", "tools"):
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bad += [f"{path.relative_to(REPO)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not bad, f"benchmarks/tools import the test tree: {bad}"
