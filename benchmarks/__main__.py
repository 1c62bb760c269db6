"""``python -m benchmarks`` (``make bench``): run the CPU benchmarks, then one summary table.

Each benchmark is its own module that prints its table and writes JSON under benchmarks/out/
(``--record``: into the tracked benchmarks/results/, benchmarks/record.py); this runner starts them
one after another (so they do not share the 2 cores), passes ``--record`` on, and summarises the
headline numbers from those JSON files.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.record import RECORD_FLAG, recording, results_dir

REPO = Path(__file__).resolve().parents[1]
RESULTS = results_dir()

# module, extra argv, result file, [(label, json path, target text)]
BENCHMARKS = [
    ("benchmarks.async_vs_sync", [], "async_vs_sync.json",
     [("async speedup", ("speedup",), ">= 2.77"), ("async trainer_idle_frac", ("runs", 1, "trainer_idle_frac"), "<= 0.05")]),
    ("benchmarks.weight_sync", [], "weight_sync.json",
     [("fs_vs_raw (1GB)", ("summary", "fs_vs_raw"), ">= 0.8"), ("broadcast_vs_raw", ("summary", "broadcast_vs_raw"), ">= 0.8")]),
    ("benchmarks.router_replay", [], "router_replay.json", [("kl_reduction", ("summary", "kl_reduction"), ">= 10")]),
    ("benchmarks.trainer_memory", [], "trainer_memory.json",
     [("FSDP state/rank, world 4 / world 1", ("setup", "state_ratio_world_max"), "<= 0.30"),
      ("lr 1e-6 update fraction, bf16 master", ("master_update_fraction", "bfloat16"), "(fp32: ~1.0)")]),
    ("tools.simulator", ["experiment=glm5_swe_28xh200", "orchestrator.num_prompts_per_step=32"],
     "simulate_glm5_swe_28xh200.json", [("28 nodes, 256 rollouts: best step_s", ("search", 0, "step_s"), "<= 300")]),
]


def dig(obj, path):
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def main(argv: list[str]) -> int:
    only = set(argv)
    rows, failed = [], []
    for module, extra, result, keys in BENCHMARKS:
        if only and module.split(".")[-1] not in only:
            continue
        if importlib.util.find_spec(module) is None:
            rows.append((module, "not implemented", "", ""))
            continue
        print(f"\n===== {module} =====", flush=True)
        t0 = time.monotonic()
        code = subprocess.call([sys.executable, "-m", module, *extra, *([RECORD_FLAG] if recording() else [])], cwd=REPO)
        if code != 0:
            failed.append(module)
        data = json.loads((RESULTS / result).read_text()) if (RESULTS / result).exists() else {}
        for label, path, target in keys:
            value = dig(data, path)
            rows.append((module.split(".")[-1], label, "-" if value is None else
                         (f"{value:.3f}" if isinstance(value, float) else str(value)), target))
        print(f"[bench] {module} took {time.monotonic() - t0:.0f}s", flush=True)
    print("\nbenchmark            metric                          value      target")
    for r in rows:
        print(f"{r[0]:<20} {r[1]:<31} {r[2]:<10} {r[3]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
