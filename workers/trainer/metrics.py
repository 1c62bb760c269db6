"""Trainer observability: ``metrics.jsonl`` + TensorBoard (rank 0) and the ``trainer[r]`` log.

One record per optimizer step goes to ``run_dir/metrics.jsonl`` (appended, flushed per
line, so ``tail -f`` and a crashed run both show every finished step) and, for every
numeric field, to TensorBoard scalars under ``run_dir/tb`` (grouped tags: ``reward/``, ``loss/``,
``timing/``, ``mismatch/``, ``weights/``, ``eval/`` ..., workers/trainer/tb_tags.py; global step =
trainer step, 1-based; an eval's at the step whose weights it evaluated). Non-finite floats are written as ``null``: JSON has no NaN.

Keys of a record (see ``loop.step_record`` for how each is computed):
  step, time, policy_version, loss, pg_loss, aux_loss, grad_norm, entropy, mismatch_kl,
  ratio_mean, ratio_max, ratio_min, ratio_masked_frac, ratio_capped_frac, clip_frac (PPO-clipped tokens),
  ref_kl (KL to the reference policy, only with one: workers/trainer/objective.py),
  routing_disagreement (only when the batch has routed_experts), expert_load_max and
  expert_load_max_l{i} / expert_load_min_l{i} per MoE layer (E x the busiest / idlest
  expert's share of routed slots: 1.0 is balance; router_replay.expert_load_metrics),
  replay_unreported_tokens (only with trainer.replay_unreported=mask), num_rows,
  num_loss_tokens, tokens_per_s, step_time_s, idle_s, trainer_idle_frac,
  weight_sync_s, weight_sync_gbps, weight_bytes, lr, and with ``weights.delta``: weight_changed_frac,
  weight_dense_bytes, weight_anchor, weight_blocked_s (what training waited for) and, of the last
  background publish that finished, weight_published_version / _bytes / _dense_bytes / _changed_frac
  and weight_publish_total_s (workers/weights/filesystem/patch_publisher.py),
  nonfinite_skipped and, on such a step, restored_step (only with weights.skip_nonfinite:
  workers/trainer/divergence.py),
  host_rss_gib (+ gpu_mem_used_gib, gpu_util_pct, gpu_temp_c ... where NVML is present:
  workers/preflight/heartbeat.py), the same as orchestrator_host_rss_gib ... for the orchestrator,
  reward_mean, max_staleness, samples_dropped_stale and every other key of the batch's
  ``meta.json["orchestrator_metrics"]`` (the orchestrator's values; the trainer fills
  reward_mean / max_staleness from the batch only when the orchestrator left them out,
  and samples_dropped_stale with 0); on steps with ``orchestrator.log_samples_every_steps``,
  ``samples`` (a list of {rank, reward, prompt, completion}: sample completions as text), which
  TensorBoard shows as a Markdown table (text tag ``samples``).
"""
from __future__ import annotations

import json
import logging
import math
from numbers import Number
from typing import Any, Optional

from workers.common import logs
from workers.common.protocol import RunPaths
from workers.trainer.tb_tags import tb_step, tb_tag


def get_logger(rank: int) -> logging.Logger:
    """``trainer[rank]`` logger (workers/common/logs.py: rank 0 logs INFO, other ranks warnings and errors)."""
    return logs.get_logger("trainer", rank)


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


def progress_line(record: dict[str, Any], num_steps: Optional[int] = None) -> str:
    """One concise line per step for the log; the full record is in metrics.jsonl."""
    def f(key: str, fmt: str) -> str:
        v = record.get(key)
        return "-" if v is None else format(v, fmt)

    parts = [
        logs.step_label(record["step"], num_steps),
        f"loss {f('loss', '.4f')}",
        f"reward {f('reward_mean', '.3f')}",
        *([f"fail {f('reward_failure_frac', '.0%')}"] if record.get("reward_failures") else []),
        f"mismatch {f('mismatch_kl', '.2e')}",  # trainer vs inference logprobs, not a KL to a reference
        f"gnorm {f('grad_norm', '.3f')}",
        f"ent {f('entropy', '.3f')}",
    ]
    if "routing_disagreement" in record:
        parts.append(f"route_dis {f('routing_disagreement', '.3f')}")
    parts += [
        f"stale {record.get('max_staleness', '-')}",
        f"{f('tokens_per_s', '.0f')} tok/s",
        f"step {f('step_time_s', '.2f')}s",
        f"idle {f('trainer_idle_frac', '.0%')}",
        f"sync {f('weight_sync_s', '.3f')}s",
    ]
    if "weight_changed_frac" in record:  # weights.delta: the share of published elements that changed
        parts.append("anchor" if record.get("weight_anchor") else f"changed {f('weight_changed_frac', '.1%')}")
    return " | ".join(parts)
