"""The run's ``metrics.jsonl`` + TensorBoard writer: the trainer's step records and the
orchestrator's final-eval record go through this one writer, so both land in the same file and
the same TensorBoard tags.

Each record is appended to ``run_dir/metrics.jsonl`` (flushed per line, so ``tail -f`` and a
crashed run both show every finished step) and, for every numeric field, written as a TensorBoard
scalar under ``run_dir/tb`` (grouped tags: ``reward/``, ``loss/``, ``timing/``, ``mismatch/``,
``weights/``, ``eval/`` ..., workers/common/tb_tags.py; global step = trainer step, 1-based; an
eval's at the step whose weights it evaluated). Non-finite floats are written as ``null``: JSON
has no NaN. The keys of the trainer's record: workers/trainer/metrics.py.
"""
from __future__ import annotations

import json
import math
from numbers import Number
from typing import Any

from workers.common.protocol import RunPaths
from workers.common.tb_tags import tb_step, tb_tag


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends step records to metrics.jsonl and mirrors numeric fields to TensorBoard."""

    def __init__(self, paths: RunPaths, *, tensorboard: bool = True, tracker: Any = None):
        """``tracker``: also log each record there (workers/trainer/tracking.py; None: off)."""
        paths.root.mkdir(parents=True, exist_ok=True)
        self.tracker = tracker
        self._file = open(paths.metrics, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # Imported lazily: tensorboard costs ~1 s of import and only rank 0 needs it.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(paths.tb_dir), flush_secs=30)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_clean(record), sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in sorted(record.items()):
                if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, Number):
                    continue
                if math.isfinite(float(value)):  # grouped: reward/ loss/ timing/ mismatch/ weights/ eval/ ...
                    self._tb.add_scalar(tb_tag(key), float(value), global_step=tb_step(key, record),
                                        walltime=record.get("time"))
            if record.get("samples"):  # orchestrator.log_samples_every_steps: the batch's samples as text
                self._tb.add_text("samples", samples_markdown(record["samples"]), global_step=step,
                                  walltime=record.get("time"))
            self._tb.flush()
        if self.tracker is not None:
            self.tracker.log_record(record)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


SAMPLE_COLUMNS = ("rank", "reward", "prompt", "completion")
"""The fields of each row of a record's ``samples`` (workers/orchestrator/evaluation.py log_samples)."""


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """A record's ``samples`` as a Markdown table (TensorBoard renders text summaries as Markdown)."""
    def cell(value: Any) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c, "")) for c in SAMPLE_COLUMNS) + " |" for r in rows])
