"""TensorBoard tags: each numeric key of a metrics.jsonl record under one group, so the dashboard
opens on sections a user scans (as verl/TRL users expect), not one flat ``trainer/`` list.

    reward/    reward_mean -> reward/mean, reward_std, reward/<name> (named rewards), reward_failures,
               reward_failure_frac, reward_timeouts, reward_calls
    eval/      eval/* as written (logged at the step whose weights were evaluated: eval/weights_step)
    loss/      loss, pg_loss, aux_loss, grad_norm, entropy, lr
    mismatch/  mismatch_kl (trainer vs inference logprobs), ratio_*, routing_disagreement,
               replay_unreported_tokens
    weights/   weights/* as written (the weight-update metrics: changed fraction, bytes sent vs dense,
               seconds blocked), and weight_* (weight_sync_s, weight_bytes, weight_update_s, ...)
    timing/    *_s, *_per_s, *_frac of time (step_time_s, tokens_per_s, trainer_idle_frac, ...)
    async/     staleness, dropped and truncated samples, policy versions, inflight groups
    data/      data/* as written (env=dataset position, skipped rows)
    experts/   expert_load_*
    system/    host and GPU memory, utilisation, temperature (host_*, gpu_*, orchestrator_*, inference_*)
    other/     anything else
"""
from __future__ import annotations

LOSS = {"loss", "pg_loss", "aux_loss", "grad_norm", "entropy", "lr"}
MISMATCH = {"mismatch_kl", "routing_disagreement", "replay_unreported_tokens"}
ASYNC = ("max_staleness", "mean_staleness", "samples_dropped", "samples_truncated", "tokens_truncated",
         "tokens_kept", "policy_version", "orchestrator_weight_version", "frac_mixed_version", "inflight_groups",
         "groups_resubmitted", "num_samples", "num_rows", "num_loss_tokens", "completion_len")
SYSTEM = ("host_", "gpu_", "orchestrator_host", "orchestrator_gpu", "inference_host", "inference_gpu",
          "inference_worker", "inference_workers")
AS_WRITTEN = ("eval/", "weights/", "data/", "reward/")
TIME_SUFFIXES = ("_s", "_per_s", "_s_total", "_idle_frac", "_busy_frac", "_gbps")


def tb_tag(key: str) -> str:
    """The TensorBoard tag of a record key (module docstring)."""
    if key.startswith(AS_WRITTEN):
        return key
    if key.startswith("reward"):
        return "reward/" + key.removeprefix("reward_").removeprefix("reward")
    if key in LOSS:
        return f"loss/{key}"
    if key in MISMATCH or key.startswith("ratio_"):
        return f"mismatch/{key}"
    if key.startswith(("weight_", "weights_")):
        return f"weights/{key}"
    if key.startswith(SYSTEM):
        return f"system/{key}"
    if key.startswith(ASYNC):
        return f"async/{key}"
    if key.startswith("expert_load"):
        return f"experts/{key}"
    if key.endswith(TIME_SUFFIXES):
        return f"timing/{key}"
    return f"other/{key}"


def tb_step(key: str, record: dict) -> int:
    """An eval's scalars sit at the step whose weights it evaluated; everything else at the record's step."""
    if key.startswith("eval/") and isinstance(record.get("eval/weights_step"), (int, float)):
        return int(record["eval/weights_step"])
    return int(record["step"])
