"""Rollout buffer with bounded staleness and group-relative advantages.

A *group* is ``num_samples_per_prompt`` samples of one prompt; its advantages are the
rewards minus the group mean, divided as ``orchestrator.advantage_norm`` says, after DAPO's
overlong shaping and with DAPO's dynamic sampling if asked (advantages.py). A group's policy version is the OLDEST
version of any token it holds (tokens of one sample may span a weight update), so the
staleness bound is checked conservatively.

Staleness rule (docs/design.md, "Step numbers"): trainer steps are 1-based, and step
``s`` trains the weights of step ``s - 1`` (``weights/step_0`` is the initial policy), so a
batch for step ``s`` may only contain samples with ``staleness(s, policy_version) = s - 1 -
policy_version <= max_off_policy_steps`` (0: on-policy); older groups are dropped and counted.
Long multi-turn episodes span many versions, so ``long_episode_policy`` says what
"older" means for them: ``drop`` (the rule above, oldest token), ``truncate`` (a group
counts by its newest turn; tokens beyond the window leave the loss but stay as context),
``keep`` (a group counts by its newest turn and keeps every token in the loss).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Optional

import numpy as np

from workers.orchestrator.advantages import batch_scale, group_scale, overlong_penalty, zero_variance


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
    completion_mask: Optional[list[int]] = None  # multi-turn: 1 = model token (trained), 0 = env token; None = all 1
    env_info: dict[str, Any] = dataclasses.field(default_factory=dict)  # multi-turn: turns, env_s, finish, ...
    ref_logprobs: Optional[np.ndarray] = None  # per completion token, under the step-0 policy (trainer.kl_coef)
    teacher_logprobs: Optional[np.ndarray] = None  # per completion token, under the teacher (on-policy distillation)

    @property
    def policy_version(self) -> int:
        """Oldest version over sampled tokens (env tokens carry -1 and are skipped)."""
        sampled = [v for v, m in zip(self.token_versions, self.loss_flags()) if m and v >= 0]
        return min(sampled) if sampled else -1

    @property
    def newest_version(self) -> int:
        """Version of the newest sampled token (the last turn's weights)."""
        sampled = [v for v in self.token_versions if v >= 0]
        return max(sampled) if sampled else -1

    def loss_flags(self) -> list[int]:
        return self.completion_mask if self.completion_mask is not None else [1] * len(self.completion_ids)


@dataclasses.dataclass
class RolloutGroup:
    group_id: int
    task_id: int
    samples: list[Sample]
    worker: int = -1
    started_version: int = 0
    env_metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_model_tokens: int = 0
    """Most model tokens a sample may generate (the env's limits; overlong shaping's L; 0: unknown, no shaping)."""
    adapter: str = ""
    """Several LoRA adapters: the one this group sampled with and trains (workers/orchestrator/adapters.py)."""

    @property
    def policy_version(self) -> int:
        return min(s.policy_version for s in self.samples)

    def shaped_rewards(self, shaping: Optional["Shaping"] = None) -> np.ndarray:
        """Each sample's reward plus its overlong penalty (advantages.overlong_penalty; 0 without shaping)."""
        rewards = np.array([s.reward for s in self.samples], dtype=np.float64)
        if shaping is None or self.max_model_tokens <= 0:
            return rewards
        return rewards + [shaping.penalty(sum(s.loss_flags()), self.max_model_tokens) for s in self.samples]

    def assign_advantages(self, mode: str = "sequence", norm: str = "none",
                          shaping: Optional["Shaping"] = None) -> None:
        """Group-relative advantages of the shaped rewards, times the ``norm`` scale (advantages.py).
        ``token_rtg``: per-position reward-to-go minus the group's mean reward-to-go at that position
        (samples that ended count 0 there; an overlong penalty lands on the last token)."""
        rewards = self.shaped_rewards(shaping)
        scale = group_scale(rewards, norm)
        for s, a in zip(self.samples, rewards - rewards.mean()):
            s.advantage = float(a * scale)
        if mode != "token_rtg" or any(s.token_rewards is None for s in self.samples):
            return
        width = max(len(s.completion_ids) for s in self.samples)
        rtg = np.zeros((len(self.samples), width))
        for i, s in enumerate(self.samples):
            r = np.asarray(s.token_rewards, dtype=np.float64).copy()
            if len(r):
                r[-1] += rewards[i] - s.reward
            rtg[i, : len(r)] = np.cumsum(r[::-1])[::-1]
        baseline = rtg.mean(axis=0)
        for i, s in enumerate(self.samples):
            n = len(s.completion_ids)
            s.token_advantages = ((rtg[i, :n] - baseline[:n]) * scale).astype(np.float32)

    def assign_distillation(self, reward_weight: float) -> None:
        """On-policy distillation: each token's advantage is the teacher's log-prob minus the one it was
        sampled with (the negative per-token reverse KL), plus ``reward_weight`` x the task advantage."""
        for s in self.samples:
            task = s.token_advantages if s.token_advantages is not None else s.advantage
            gap = np.asarray(s.teacher_logprobs, np.float64) - np.asarray(s.completion_logprobs, np.float64)
            s.token_advantages = (gap + reward_weight * np.asarray(task, np.float64)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Shaping:
    """DAPO's soft overlong punishment (orchestrator.overlong_buffer_frac / overlong_penalty)."""

    buffer_frac: float
    penalty_max: float

    def penalty(self, num_tokens: int, max_tokens: int) -> float:
        buffer = max(1, round(self.buffer_frac * max_tokens)) if self.buffer_frac > 0 else 0
        return overlong_penalty(num_tokens, max_tokens, buffer, self.penalty_max)


class RolloutBuffer:
    """FIFO of completed groups; ``take`` builds one step's worth, dropping stale groups."""

    def __init__(self, *, max_off_policy_steps: int, groups_per_step: int, advantage: str = "sequence",
                 long_episode_policy: str = "drop", advantage_norm: str = "none", shaping: Optional[Shaping] = None,
                 dynamic_sampling: bool = False, max_draws: int = 4, distill_reward_weight: Optional[float] = None):
        if max_off_policy_steps < 0:
            raise ValueError(f"orchestrator.max_off_policy_steps must be >= 0, got {max_off_policy_steps}")
        if long_episode_policy not in LONG_EPISODE_POLICIES:
            raise ValueError(f"orchestrator.long_episode_policy={long_episode_policy!r}; choose one of "
                             f"{LONG_EPISODE_POLICIES}")
        self.policy = long_episode_policy
        self.tokens_truncated_total = 0
        self.tokens_kept_stale_total = 0
        self.samples_truncated_total = 0
        self.max_off = max_off_policy_steps
        self.groups_per_step = groups_per_step
        self.advantage = advantage
        self.groups: deque[RolloutGroup] = deque()
        self.dropped_samples_total = 0
        self.advantage_norm, self.shaping = advantage_norm, shaping
        self.dynamic_sampling, self.max_draws = dynamic_sampling, max_draws
        self.drawn_for_batch = 0  # groups added since the last batch was taken (dynamic sampling's budget)
        self.zero_var_dropped_total = 0
        self.zero_var_kept_total = 0
        self.distill_weight = distill_reward_weight  # None: no teacher

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: RolloutGroup) -> bool:
        """Put a finished group in the buffer; False when dynamic sampling drops it (its rewards are all
        equal and the batch's draw budget, max_draws x groups_per_step, is not yet spent)."""
        self.drawn_for_batch += 1
        if self.dynamic_sampling and zero_variance(group.shaped_rewards(self.shaping)):
            if self.drawn_for_batch <= self.max_draws * self.groups_per_step:
                self.zero_var_dropped_total += 1
                return False
            self.zero_var_kept_total += 1
        group.assign_advantages(self.advantage, self.advantage_norm, self.shaping)
        if self.distill_weight is not None:
            group.assign_distillation(self.distill_weight)
        self.groups.append(group)
        return True

    def sampling_metrics(self, groups: list[RolloutGroup]) -> dict[str, Any]:
        """A batch's recipe counters: dynamic sampling's drops (and zero-variance groups kept once
        its draw budget was spent), the mean overlong penalty; only the knobs in use."""
        out: dict[str, Any] = {}
        if self.dynamic_sampling:
            out["groups_dropped_zero_var_total"] = self.zero_var_dropped_total
            out["groups_kept_zero_var_total"] = self.zero_var_kept_total
        if self.distill_weight is not None:  # mean over the sampled tokens of log pi_student - log pi_teacher
            gaps = [(np.asarray(s.completion_logprobs) - s.teacher_logprobs)[np.asarray(s.loss_flags(), bool)]
                    for g in groups for s in g.samples]
            out["teacher_reverse_kl"] = float(np.concatenate(gaps).mean()) if gaps else 0.0
        if self.shaping is not None:
            shaped = np.concatenate([g.shaped_rewards(self.shaping) - [s.reward for s in g.samples] for g in groups])
            out["overlong_penalty_mean"] = float(shaped.mean())
            out["overlong_frac"] = float((shaped < 0).mean())
        return out

    def version_of(self, g: RolloutGroup) -> int:
        """The version the staleness rule checks: oldest token (drop) or oldest newest-turn."""
        if self.policy == "drop":
            return g.policy_version
        return min(s.newest_version for s in g.samples)

    def drop_stale(self, step: int) -> int:
        """Remove groups too old for ``step``; returns samples dropped."""
        keep, dropped = deque(), 0
        for g in self.groups:
            if staleness(step, self.version_of(g)) > self.max_off:
                dropped += len(g.samples)
            else:
                keep.append(g)
        self.groups = keep
        self.dropped_samples_total += dropped
        return dropped

    def usable(self, step: int) -> int:
        return sum(1 for g in self.groups if staleness(step, self.version_of(g)) <= self.max_off)

    def take(self, step: int) -> Optional[list[RolloutGroup]]:
        """Oldest usable groups for ``step`` (oldest first, so fewer go stale) or None.

        Stale groups are dropped first; ``dropped_samples_total`` counts them.
        """
        self.drop_stale(step)
        if len(self.groups) < self.groups_per_step:
            return None
        groups = [self.groups.popleft() for _ in range(self.groups_per_step)]
        self.drawn_for_batch = len(self.groups)  # the groups left over count toward the next batch
        if self.advantage_norm == "batch_std":
            scale = batch_scale([s.advantage for g in groups for s in g.samples])
            for s in (s for g in groups for s in g.samples):
                s.advantage *= scale
                if s.token_advantages is not None:
                    s.token_advantages = (s.token_advantages * scale).astype(np.float32)
        if self.policy != "drop":
            for g in groups:
                self.apply_long_episode_policy(g, step)
        return groups

    def apply_long_episode_policy(self, g: RolloutGroup, step: int) -> None:
        """truncate: tokens older than the window leave the loss (mask 0); keep: count them."""
        oldest_ok = step - 1 - self.max_off  # the oldest version within the window of ``step``
        for s in g.samples:
            flags = s.loss_flags()
            stale = [i for i, (v, m) in enumerate(zip(s.token_versions, flags)) if m and 0 <= v < oldest_ok]
            if not stale:
                continue
            if self.policy == "keep":
                self.tokens_kept_stale_total += len(stale)
                continue
            mask = list(flags)
            for i in stale:
                mask[i] = 0
            s.completion_mask = mask
            self.tokens_truncated_total += len(stale)
            self.samples_truncated_total += 1


LONG_EPISODE_POLICIES = ("drop", "truncate", "keep")


def staleness(step: int, version: int) -> int:
    """How many updates behind the weights that trainer step ``step`` (1-based) trains a sample
    of policy ``version`` is: step ``s`` starts from version ``s - 1``."""
    return step - 1 - version


def groups_to_launch(*, next_step: int, weight_version: int, max_off: int, groups_per_step: int,
                     buffered_usable: int, inflight_groups: int, spare: int = 0) -> int:
    """How many new groups are worth starting now.

    A group started at ``weight_version`` can serve the batches of steps ``next_step ..
    weight_version + 1 + max_off`` (1-based steps: step s trains version s - 1); starting more
    than those batches need would only produce stale samples.
    With max_off = 0 this yields exactly one batch per version: synchronous training.
    ``spare`` extra groups keep inference busy while long-tail episodes finish; the batch
    takes whichever groups complete first.
    """
    last_usable_step = weight_version + 1 + max_off
    if last_usable_step < next_step:
        return 0
    needed = (last_usable_step - next_step + 1) * groups_per_step + spare
    return max(0, needed - buffered_usable - inflight_groups)
