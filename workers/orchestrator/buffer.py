"""Rollout buffer with bounded staleness and group-relative advantages.

A *group* is ``num_samples_per_prompt`` samples of one prompt; its advantages are the
rewards minus the group mean (GRPO-style, no std division: with 0/1-ish partial credit a
std division blows up near-uniform groups). A group's policy version is the OLDEST
version of any token it holds (tokens of one sample may span a weight update), so the
staleness bound is checked conservatively.

Staleness rule (DESIGN.md 2): a batch for trainer step ``s`` may only contain samples with
``s - policy_version <= max_off_policy_steps``; older groups are dropped and counted.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    token_versions: list[int]
    reward: float
    finish_reason: str
    routed_experts: Optional[np.ndarray] = None  # [prompt+completion-1, L, k] uint8/uint16
    token_rewards: Optional[list[float]] = None  # per completion token, sums to reward
    advantage: float = 0.0
    token_advantages: Optional[np.ndarray] = None  # per completion token (mode token_rtg)

    @property
    def policy_version(self) -> int:
        return min(self.token_versions) if self.token_versions else -1


@dataclasses.dataclass
class RolloutGroup:
    group_id: int
    task_id: int
    samples: list[Sample]
    worker: int = -1
    started_version: int = 0
    env_metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        return min(s.policy_version for s in self.samples)

    def assign_advantages(self, mode: str = "sequence") -> None:
        """Group-relative advantages. ``token_rtg``: per-position reward-to-go minus the
        group's mean reward-to-go at that position (samples that ended count 0 there)."""
        rewards = np.array([s.reward for s in self.samples], dtype=np.float64)
        for s, a in zip(self.samples, rewards - rewards.mean()):
            s.advantage = float(a)
        if mode != "token_rtg" or any(s.token_rewards is None for s in self.samples):
            return
        width = max(len(s.completion_ids) for s in self.samples)
        rtg = np.zeros((len(self.samples), width))
        for i, s in enumerate(self.samples):
            r = np.asarray(s.token_rewards, dtype=np.float64)
            rtg[i, : len(r)] = np.cumsum(r[::-1])[::-1]
        baseline = rtg.mean(axis=0)
        for i, s in enumerate(self.samples):
            n = len(s.completion_ids)
            s.token_advantages = (rtg[i, :n] - baseline[:n]).astype(np.float32)


class RolloutBuffer:
    """FIFO of completed groups; ``take`` builds one step's worth, dropping stale groups."""

    def __init__(self, *, max_off_policy_steps: int, groups_per_step: int, advantage: str = "sequence"):
        if max_off_policy_steps < 0:
            raise ValueError(f"orchestrator.max_off_policy_steps must be >= 0, got {max_off_policy_steps}")
        self.max_off = max_off_policy_steps
        self.groups_per_step = groups_per_step
        self.advantage = advantage
        self.groups: deque[RolloutGroup] = deque()
        self.dropped_samples_total = 0

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: RolloutGroup) -> None:
        group.assign_advantages(self.advantage)
        self.groups.append(group)

    def drop_stale(self, step: int) -> int:
        """Remove groups too old for ``step``; returns samples dropped."""
        keep, dropped = deque(), 0
        for g in self.groups:
            if step - g.policy_version > self.max_off:
                dropped += len(g.samples)
            else:
                keep.append(g)
        self.groups = keep
        self.dropped_samples_total += dropped
        return dropped

    def usable(self, step: int) -> int:
        return sum(1 for g in self.groups if step - g.policy_version <= self.max_off)

    def take(self, step: int) -> Optional[list[RolloutGroup]]:
        """Oldest usable groups for ``step`` (oldest first, so fewer go stale) or None.

        Stale groups are dropped first; ``dropped_samples_total`` counts them.
        """
        self.drop_stale(step)
        if len(self.groups) < self.groups_per_step:
            return None
        return [self.groups.popleft() for _ in range(self.groups_per_step)]


def groups_to_launch(*, next_step: int, weight_version: int, max_off: int, groups_per_step: int,
                     buffered_usable: int, inflight_groups: int) -> int:
    """How many new groups are worth starting now.

    A group started at ``weight_version`` can serve batches ``next_step .. weight_version +
    max_off``; starting more than those batches need would only produce stale samples.
    With max_off = 0 this yields exactly one batch per version: synchronous training.
    """
    last_usable_step = weight_version + max_off
    if last_usable_step < next_step:
        return 0
    needed = (last_usable_step - next_step + 1) * groups_per_step
    return max(0, needed - buffered_usable - inflight_groups)
