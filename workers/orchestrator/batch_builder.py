"""Turn rollout groups into the trainer's batch files (format: workers/common/protocol.py).

Everything stays numpy and binary: routed experts go straight from the client's decoded
arrays into the safetensors file, never through JSON.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from safetensors.numpy import save_file

from workers.common.atomic_dir import publish_dir
from workers.common.protocol import READY, RunPaths
from workers.orchestrator.adapters import adapter_ids
from workers.orchestrator.buffer import RolloutGroup, staleness

PAD = 0


def build_batch_arrays(groups: list[RolloutGroup], *, num_layers: int, top_k: int,
                       adapters: Sequence[str] = ()) -> dict[str, np.ndarray]:
    samples = [s for g in groups for s in g.samples]
    seq_len = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    b = len(samples)
    input_ids = np.full((b, seq_len), PAD, dtype=np.int64)
    attention_mask = np.zeros((b, seq_len), dtype=np.uint8)
    loss_mask = np.zeros((b, seq_len), dtype=np.uint8)
    logprobs = np.zeros((b, seq_len), dtype=np.float32)
    versions = np.full((b, seq_len), -1, dtype=np.int32)
    per_token = all(s.token_advantages is not None for s in samples)
    advantages = np.zeros((b, seq_len), dtype=np.float32) if per_token else np.array(
        [s.advantage for s in samples], dtype=np.float32)
    have_ref = all(s.ref_logprobs is not None for s in samples)
    ref = np.zeros((b, seq_len), dtype=np.float32)
    have_routing = all(s.routed_experts is not None for s in samples)
    routed_dtype = np.uint8
    if have_routing:
        routed_dtype = samples[0].routed_experts.dtype
        routed = np.zeros((b, seq_len, num_layers, top_k), dtype=routed_dtype)
        routed_mask = np.zeros((b, seq_len), dtype=np.uint8)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p:p + c] = s.completion_ids
        attention_mask[i, :p + c] = 1
        loss_mask[i, p:p + c] = 1 if s.completion_mask is None else s.completion_mask  # multi-turn: env tokens 0
        logprobs[i, p:p + c] = s.completion_logprobs
        versions[i, p:p + c] = s.token_versions
        if per_token:
            advantages[i, p:p + c] = s.token_advantages
        if have_ref:
            ref[i, p:p + c] = s.ref_logprobs
        if have_routing:
            n = min(s.routed_experts.shape[0], p + c)
            routed[i, :n] = s.routed_experts[:n]
            routed_mask[i, :n] = 1
    arrays = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "inference_logprobs": logprobs,
        "advantages": advantages,
        "rewards": np.array([s.reward for s in samples], dtype=np.float32),
        "token_versions": versions,
    }
    if have_ref:  # the step-0 policy's log-probs: the trainer's KL penalty (trainer.kl_coef)
        arrays["ref_logprobs"] = ref
    if have_routing:
        arrays["routed_experts"] = routed
        arrays["routed_mask"] = routed_mask
    if adapters:  # several LoRA adapters: the adapter each row trains (workers/orchestrator/adapters.py)
        arrays["adapter_ids"] = adapter_ids(groups, adapters)
    return arrays


def batch_metrics(step: int, groups: list[RolloutGroup]) -> dict[str, Any]:
    samples = [s for g in groups for s in g.samples]
    rewards = np.array([s.reward for s in samples])
    trained = [s for s in samples if s.policy_version >= 0] or samples  # all-truncated samples train nothing
    stale = np.array([staleness(step, s.policy_version) for s in trained])
    lengths = np.array([len(s.completion_ids) for s in samples])
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "max_staleness": int(stale.max()),
        "policy_version_min": int(min(s.policy_version for s in trained)),
        "policy_version_max": int(max(s.newest_version for s in samples)),
        "mean_staleness": float(stale.mean()),
        "completion_len_mean": float(lengths.mean()),
        "num_samples": len(samples),
        "frac_mixed_version": float(np.mean([len({v for v in s.token_versions if v >= 0}) > 1 for s in samples])),
    }


def write_batch(paths: RunPaths, step: int, groups: list[RolloutGroup], *, num_layers: int, top_k: int,
                temperature: float, extra_metrics: dict[str, Any], adapters: Sequence[str] = ()) -> None:
    """Publish rollouts/step_N atomically: batch.safetensors, meta.json, then READY."""
    arrays = build_batch_arrays(groups, num_layers=num_layers, top_k=top_k, adapters=adapters)
    metrics = {**batch_metrics(step, groups), **extra_metrics}
    meta = {
        "step": step,
        "temperature": temperature,
        "orchestrator_metrics": metrics,
        "samples": [{"group_id": g.group_id, "task_id": g.task_id, "policy_versions": [s.policy_version for s in g.samples]}
                    for g in groups],
    }

    def write(tmp: Path) -> None:
        save_file(arrays, str(tmp / "batch.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta))

    paths.rollouts(step).parent.mkdir(parents=True, exist_ok=True)
    publish_dir(paths.rollouts(step), write, READY)
