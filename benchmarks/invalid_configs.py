"""Count how the launcher treats the invalid-config table of tests/unit/launcher/test_invalid_configs.py.

    PYTHONPATH=. python benchmarks/invalid_configs.py [--show]

Each override goes the CLI's way before anything is written: Hydra composes it, then
``reject_unknown_keys``, ``conform_sections`` and ``build_plan``. Outcomes: ``clean`` (refused with
an error the CLI prints as ``slurmrl: error: ...`` or Hydra's own message, exit 2, naming the key),
``unnamed`` (refused cleanly but the message lacks the key), ``crashed`` (an exception the CLI does
not treat as a user error: a Python traceback) and ``accepted`` (planned as if valid).
"""
from __future__ import annotations

import collections
import runpy
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf

from launcher.__main__ import USER_ERRORS
from launcher.config_store import reject_unknown_keys
from launcher.plan import build_plan
from workers.common.config import conform_sections

TABLE = Path(__file__).resolve().parents[1] / "tests/unit/launcher/test_invalid_configs.py"


def outcome(override: str, key: str) -> tuple[str, str]:
    try:
        with initialize_config_module(config_module="hydra_conf", version_base=None):
            composed = compose(config_name="config", overrides=override.split())
    except HydraException as e:  # Hydra prints these itself (no traceback); the CLI exits 2
        text = f"{e} {e.__cause__ or ''}"
        return ("clean" if key in text else "unnamed"), text
    try:
        reject_unknown_keys(composed)
        build_plan(conform_sections(OmegaConf.to_object(composed)))
    except USER_ERRORS as e:
        return ("clean" if key in str(e) else "unnamed"), str(e)
    except Exception as e:  # noqa: BLE001  (what a user would see as a traceback)
        return "crashed", f"{type(e).__name__}: {e}"
    return "accepted", ""


def main() -> int:
    table = runpy.run_path(str(TABLE))
    groups = {"existing": table["CASES"], "issue 22": table.get("RANGE_CASES", [])}
    for name, cases in groups.items():
        counts = collections.Counter()
        for override, key in cases:
            kind, text = outcome(override, key)
            counts[kind] += 1
            if "--show" in sys.argv and kind != "clean":
                print(f"  {kind:8} {override}  [{key}]  {text[:160]}")
        print(f"{name}: tried {len(cases)}, " + ", ".join(f"{k} {counts[k]}" for k in
                                                          ("clean", "unnamed", "crashed", "accepted")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
