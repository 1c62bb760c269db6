"""The two built-in weight transports never import each other: ``workers/weights/filesystem`` and ``broadcast``.

Why: each used to reach into the other (11 imports, most inside functions) for its SGLang code, the patch
index and the config, so neither could change or be read alone (issue 46). What both need lives in a neutral
home: ``workers/weights/sglang`` (SGLang's side of both), ``workers/weights/delta`` (the patch format, its
index, the shared config fields) or ``workers/weights`` itself; the broadcast transport reaches the filesystem
transport's publisher and receiver (step 0 on disk) through the ``TRANSPORTS`` registry, as any role does.

Every file is parsed (ast): module-level, function-local and ``if TYPE_CHECKING:`` imports all count, and so
does a dotted module path in a string (``lazy("workers.weights.broadcast...")``, a custom loader's import
path), which imports the module as surely as an import statement.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.repo.test_import_graph import REPO, all_modules, imports_of

SIDES = ("workers.weights.filesystem", "workers.weights.broadcast")


def side(module: str) -> str:
    return next((s for s in SIDES if module == s or module.startswith(s + ".")), "")


def string_targets(path: Path) -> set[str]:
    """Dotted module paths named in string constants (``pkg.mod`` or ``pkg.mod:attr``/``pkg.mod.attr``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("workers."):
            out.add(node.value.split(":")[0])
    return out


def crossings(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where one transport's module imports (or names) the other's."""
    bad = []
    for name, path in modules.items():
        own = side(name)
        if not own:
            continue
        deps = imports_of(name, path, modules) | {s for s in string_targets(path) if side(s)}
        bad += [(name, d) for d in deps if side(d) and side(d) != own]
    return sorted(set(bad))


def test_crossing_finder_sees_lazy_type_only_and_string_imports(tmp_path):
    """Each way one transport can reach the other is found (and an import of a neutral module is not)."""
    root = tmp_path / "workers" / "weights"
    files = {
        "workers.weights.filesystem.a": "def f():\n    from workers.weights.broadcast.b import x\n",
        "workers.weights.broadcast.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from workers.weights.filesystem import a\nx = 1\n"),
        "workers.weights.broadcast.c": 'LOADER = "workers.weights.filesystem.a.f"\n',
        "workers.weights.filesystem.d": "from workers.weights.sglang import e\n",
        "workers.weights.sglang.e": "from workers.weights.broadcast import b\nfrom workers.weights.filesystem import a\n",
    }
    modules = {}
    for name, text in files.items():
        path = root / Path(*name.split(".")[2:]).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        modules[name] = path
    assert crossings(modules) == [("workers.weights.broadcast.b", "workers.weights.filesystem.a"),
                                  ("workers.weights.broadcast.c", "workers.weights.filesystem.a.f"),
                                  ("workers.weights.filesystem.a", "workers.weights.broadcast.b")]


def test_filesystem_and_broadcast_never_import_each_other():
    modules = all_modules()
    assert any(side(m) == SIDES[0] for m in modules) and any(side(m) == SIDES[1] for m in modules), \
        f"no modules under {SIDES} under {REPO}: the test would pass vacuously"
    bad = crossings(modules)
    assert not bad, ("weights/filesystem and weights/broadcast import each other (move the shared piece to "
                     "workers/weights/sglang, workers/weights/delta or workers/weights):\n" +
                     "\n".join(f"{a} -> {b}" for a, b in bad))
