"""Experiment trackers beside metrics.jsonl and TensorBoard: ``tracking.wandb=true`` (trainer rank 0).

Every record the trainer writes to metrics.jsonl (metrics.py ``MetricsWriter.write``) is also
logged to the tracker with the same ``step`` (1-based, as everywhere), numeric fields only —
including the orchestrator's (reward/<name>, reward_failures, data/*) and evaluation rows
(eval/reward) — plus a record's sample completions (``samples``) as a ``wandb.Table``. The run is named after the run directory, its id is derived from it (a resumed
trainer continues the same W&B run), and the resolved config (run.yaml) is its config.

Offline by default (``tracking.wandb_mode=offline``): GPU clusters often have no internet; the
files land in ``run_dir/wandb/`` and ``wandb sync`` uploads them later. The plan refuses
``tracking.wandb=true`` where wandb is not installed (launcher/plan.py ``check_tracking``).
A tracker error never stops training: it is logged once and the tracker is switched off.
Tested with the real package offline (tests/unit/trainer/test_tracking_wandb.py reads its run files back);
the fake (tests/fakes/fake_wandb.py) only for the failure paths.
"""
from __future__ import annotations

import hashlib
import logging
import math
from numbers import Number
from typing import Any, Optional

from workers.common.protocol import RunPaths
from workers.common.metrics import SAMPLE_COLUMNS


class WandbTracker:
    def __init__(self, cfg: Any, paths: RunPaths, *, log: logging.Logger):
        import wandb  # the plan checked that it is installed
        from omegaconf import OmegaConf

        t = cfg.tracking
        self.log, self.wandb = log, wandb
        (paths.root / "wandb").mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha1(str(paths.root.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=t.wandb_project or f"slurmrl-{cfg.experiment}", entity=t.wandb_entity or None,
                              name=paths.root.name, id=run_id, resume="allow", mode=t.wandb_mode,
                              dir=str(paths.root), config=OmegaConf.to_container(OmegaConf.structured(cfg)))

    def log_record(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        values: dict[str, Any] = {k: float(v) for k, v in record.items() if k not in ("step", "time")
                                  and isinstance(v, Number) and not isinstance(v, bool) and math.isfinite(float(v))}
        try:
            if record.get("samples"):  # the batch's sample completions as text: a table per logged step
                values["samples"] = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[
                    [row.get(c) for c in SAMPLE_COLUMNS] for row in record["samples"]])
            self.run.log(values, step=int(record["step"]))
        except Exception as e:  # a tracker must never stop training
            self.log.error(f"wandb: logging failed ({type(e).__name__}: {e}); tracking off for the rest of the run")
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
            teardown = getattr(self.wandb, "teardown", None)
            if teardown is not None:  # wandb-core writes the offline run file out here, not in finish():
                teardown()            # a trainer stopped right after close() keeps every record


def make_tracker(cfg: Any, paths: RunPaths, *, log: logging.Logger) -> Optional[WandbTracker]:
    """The trackers ``cfg.tracking`` asks for (None: TensorBoard and metrics.jsonl only)."""
    return WandbTracker(cfg, paths, log=log) if cfg.tracking.wandb else None
