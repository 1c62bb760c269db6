"""Login-node side of ``model.pretrained``: refuse a missing checkpoint package before anything is
written, pin the cache directory into the config, and convert once before roles start.

No torch here (launcher/ never imports it): the conversion runs as a child process,
``python -m <source's converter>`` (workers/models/llama/convert.py for SmolLM2), whose progress lines
stream to this terminal. It runs on the node that launches (login node or this machine) and
writes to ``model.pretrained_dir``, which must be on a filesystem the compute nodes mount.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from launcher.resources import PlanError
from workers.common.config import RunConfig
from workers.models.pretrained import PretrainedMissing, default_dir, find_gguf, is_prepared, source


def pin_pretrained_dir(cfg: RunConfig) -> RunConfig:
    """``model.pretrained_dir`` made explicit (the roles read it), after checking that the checkpoint
    exists already or its package is installed (PlanError with the install command otherwise)."""
    m = cfg.model
    if not m.pretrained:
        return cfg
    directory = Path(m.pretrained_dir).expanduser().resolve() if m.pretrained_dir else default_dir(m.pretrained)
    if not is_prepared(m.pretrained, directory):
        try:
            find_gguf(m.pretrained)
        except PretrainedMissing as e:
            raise PlanError(str(e)) from None
    return dataclasses.replace(cfg, model=dataclasses.replace(m, pretrained_dir=str(directory)))


def ensure_converted(cfg: RunConfig) -> None:
    """Convert ``model.pretrained`` into ``model.pretrained_dir`` unless it is there; raises PlanError
    with the converter's message when it fails."""
    m = cfg.model
    if not m.pretrained or is_prepared(m.pretrained, Path(m.pretrained_dir)):
        return
    print(f"[slurmrl] converting {m.pretrained} into {m.pretrained_dir} (once; later runs reuse it)", flush=True)
    cmd = [sys.executable, "-m", source(m.pretrained).converter, m.pretrained, "--dir", m.pretrained_dir]
    proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PlanError(f"converting model.pretrained={m.pretrained} failed (exit {proc.returncode}): {tail}")
