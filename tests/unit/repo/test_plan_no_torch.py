"""The login-node side never imports torch (docs/design.md, "Layout": launcher/ never imports torch).

Checked in a fresh interpreter: importing every launcher module, composing and planning
the largest experiment and rendering its script must leave 'torch' out of sys.modules.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODULES = sorted(p.stem for p in (REPO / "launcher").glob("*.py") if p.stem != "__init__")

SCRIPT = f"""
import importlib, sys
for m in {MODULES!r}:
    importlib.import_module("launcher." + m)
from tests.conftest import GLM5, plan
from launcher.render import render_script
render_script(plan(GLM5), run_dir="/r", python="/p", workdir="/w", script_path="/r/s")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "safetensors"))
print(heavy)
assert not heavy, heavy
"""


def test_launcher_does_not_import_torch():
    assert "__main__" in MODULES and "plan" in MODULES
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
