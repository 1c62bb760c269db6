"""``slurmrl export [--merge] RUN_OR_STEP OUT [--base BASE] [--adapter NAME]``: a published step as one Hugging Face directory,
on this machine (``slurmrl submit export`` runs the same as a Slurm job).

- ``--merge``: a LoRA step (a PEFT adapter, or a run directory: its newest one) merged into its base
  (``python -m workers.weights.lora_merge``), for tools without peft; the adapter directory itself
  already loads with ``peft.PeftModel.from_pretrained(base, step_dir)``. A step of several adapters
  (``trainer.lora.adapters``): ``--adapter NAME`` (or ``step_N/adapters/NAME``), one merged model each.
- without: a full or delta step resolved into a self-contained directory
  (``python -m workers.weights.filesystem.resolve``).
The work needs torch, the launcher does not import it: each runs as a subprocess of this Python.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USAGE = "usage: slurmrl export [--merge] RUN_OR_STEP OUT [--base BASE_DIR] [--adapter NAME]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return 0 if argv else 2
    merge = "--merge" in argv
    args = [a for a in argv if a != "--merge"]
    module = "workers.weights.lora_merge" if merge else "workers.weights.filesystem.resolve"
    wrong = [a for a in ("--base", "--adapter") if a in args]
    if not merge and wrong:
        print(f"slurmrl export: error: {wrong[0]} goes with --merge\n{USAGE}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", module, *args], cwd=Path.cwd())
