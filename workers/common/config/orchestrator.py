"""Orchestrator section: rollout scheduling, staleness, advantages, health checks."""
from __future__ import annotations

import dataclasses

from workers.common.config.ranges import ANY_NUMBER, between, ge, gt, limits, one_of


@dataclasses.dataclass(kw_only=True)
class OrchestratorConfig:
    max_off_policy_steps: int = 2
    """A batch for step s (1-based) takes only samples with s - 1 - policy_version <= this; 0 is synchronous."""
    max_inflight_rollouts: int = 64
    """Most generation requests outstanding over all inference workers."""
    num_prompts_per_step: int = 16
    """Distinct prompts in one trainer batch."""
    num_samples_per_prompt: int = 4
    """Samples per prompt (at least 2): advantages are relative to the prompt's group."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores with the same one)."""
    request_timeout_s: float = 120.0
    """HTTP deadline of one generate call."""
    weight_update_timeout_s: float = 120.0
    """Deadline for a worker to load new weights."""
    advantage: str = "token_rtg"
    """``sequence``: reward minus group mean, same for every token (GRPO). ``token_rtg``:
    each token's reward-to-go minus the group mean at that position (needs an env with
    per-token rewards; sums to the same episode reward, far less credit-assignment noise)."""
    advantage_norm: str = "none"
    """What the group-centred advantages are divided by (workers/orchestrator/advantages.py): ``none``
    (Dr. GRPO), ``group_std`` (the group's reward std: GRPO, DAPO) or ``batch_std`` (the std over the
    batch's advantages). Equal rewards in a group give advantage 0 under every choice."""
    overlong_buffer_frac: float = 0.0
    """DAPO's soft overlong punishment: in the last this fraction of the tokens a sample may generate
    (L: the env's max new tokens per turn x turns, at most its episode budget) the reward falls linearly
    to ``-overlong_penalty``; 0 (default): off. DAPO: 0.2 (a 4096-token buffer of 20480)."""
    overlong_penalty: float = 1.0
    """Largest overlong punishment (a sample that hits the generation limit gets ``-this``)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage, no gradient) are
    dropped and more prompts drawn until the batch is full (counted as ``groups_dropped_zero_var``)."""
    dynamic_sampling_max_draws: int = 4
    """With dynamic_sampling: after this many times ``num_prompts_per_step`` groups drawn for one batch,
    zero-variance groups are kept (a task the policy always or never solves cannot stall the run)."""
    return_routed_experts: bool = True
    """Ask inference for the experts each token used (for Router Replay and metrics); a dense
    model (model.num_experts=0) has none, so nothing is asked whatever this says."""
    long_episode_policy: str = "drop"
    """What a batch does with a group whose oldest tokens are beyond max_off_policy_steps:
    ``drop`` it (counted in samples_dropped_stale; single-turn default), ``truncate`` its
    too-old tokens out of the loss (they stay as context; counted in tokens_truncated_stale),
    or ``keep`` it whole when its newest turn is within the window (TIS corrects; counted in
    tokens_kept_stale). Long multi-turn episodes span many weight updates: drop wastes them."""
    num_spare_groups: int = 0
    """Groups started beyond what the next batches need, so a few long-tail episodes never
    hold a batch back (batches take whichever groups finish first)."""
    health_check_interval_s: float = 2.0
    """Seconds between health checks of every inference worker (dead ones: probes for revival)."""
    health_check_timeout_s: float = 10.0
    """Deadline of one health check (/health_generate: a 1-token generation on a busy engine)."""
    num_health_misses: int = 2
    """Consecutive failed health checks after which a worker is dead: no new groups, its
    in-flight groups resubmitted elsewhere (a refused connection marks it dead at once)."""

    eval_every_steps: int = 0
    """Evaluate the policy each time the orchestrator loads weights this many versions past the last
    evaluation (and once on the initial weights): greedy answers to the env's eval split, mean reward
    as ``eval/reward`` in the next batch's metrics.jsonl record; 0 = off. Needs an env with an eval
    split (env=dataset with env.eval_path or env.eval_fraction). Runs beside rollouts: no stall."""
    eval_num_samples: int = 32
    """Eval records answered per evaluation (the first ones of the eval split, the same each time)."""
    eval_k: int = 1
    """Answers per eval record: 1 = one greedy answer; k > 1 = k samples at ``temperature``, reported
    as ``eval/pass@k`` (records with at least one success) beside ``eval/pass@1``."""
    eval_success_reward: float = 1.0
    """An eval answer with at least this reward counts as a success (pass@1, pass@k)."""
    log_samples_every_steps: int = 0
    """Every this many batches, log ``num_logged_samples`` of the batch's samples (prompt, completion,
    reward) as text: to the orchestrator log, metrics.jsonl (``samples``), TensorBoard (text) and W&B
    (a table); 0 = off. Evaluations log their first answer too."""
    num_logged_samples: int = 2
    """Samples per logged batch, spread over its rewards from the best to the worst (2: best and worst)."""
    max_failed_reward_steps: int = 3
    """Stop the run (orchestrator exit code 78, not restarted) when every reward call of this many
    consecutive batches failed (raised, timed out or returned a non-number), naming the first
    failure; 0 = never stop (failures still score 0 and are counted)."""


limits(OrchestratorConfig, max_off_policy_steps=ge(0), max_inflight_rollouts=gt(0), num_prompts_per_step=gt(0),
       num_samples_per_prompt=ge(2), temperature=gt(0), request_timeout_s=gt(0), weight_update_timeout_s=gt(0),
       advantage=one_of("sequence", "token_rtg"), advantage_norm=one_of("none", "group_std", "batch_std"),
       overlong_buffer_frac=between(0, 1, hi_open=True), overlong_penalty=between(0, 100), dynamic_sampling_max_draws=between(1, 1000), long_episode_policy=one_of("drop", "truncate", "keep"),
       num_spare_groups=ge(0), eval_every_steps=ge(0), eval_num_samples=gt(0), eval_k=gt(0),
       eval_success_reward=ANY_NUMBER, log_samples_every_steps=ge(0), num_logged_samples=between(1, 64),
       max_failed_reward_steps=ge(0),
       health_check_interval_s=gt(0), health_check_timeout_s=gt(0), num_health_misses=gt(0))
