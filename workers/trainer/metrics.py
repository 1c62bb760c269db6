"""Trainer observability: the step record's keys, the ``trainer[r]`` log and its one line per step.

One record per optimizer step goes to ``run_dir/metrics.jsonl`` and TensorBoard through the run's
writer (workers/common/metrics.py: rank 0; the orchestrator appends the final eval's record with
the same writer).

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
  workers/common/heartbeat.py), the same as orchestrator_host_rss_gib ... for the orchestrator,
  reward_mean, max_staleness, samples_dropped_stale and every other key of the batch's
  ``meta.json["orchestrator_metrics"]`` (the orchestrator's values; the trainer fills
  reward_mean / max_staleness from the batch only when the orchestrator left them out,
  and samples_dropped_stale with 0); on steps with ``orchestrator.log_samples_every_steps``,
  ``samples`` (a list of {rank, reward, prompt, completion}: sample completions as text), which
  TensorBoard shows as a Markdown table (text tag ``samples``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from workers.common import logs


def get_logger(rank: int) -> logging.Logger:
    """``trainer[rank]`` logger (workers/common/logs.py: rank 0 logs INFO, other ranks warnings and errors)."""
    return logs.get_logger("trainer", rank)


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
