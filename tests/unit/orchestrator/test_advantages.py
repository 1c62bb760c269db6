"""The recipe knobs of the orchestrator on hand-computed groups (workers/orchestrator/advantages.py,
buffer.py): advantage normalisation, DAPO's overlong shaping and dynamic sampling."""
import math

import numpy as np
import pytest

from workers.orchestrator.advantages import overlong_penalty
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, Sample, Shaping


def sample(reward, n=3, token_rewards=None):
    return Sample(prompt_ids=[1, 2], completion_ids=[5] * n, completion_logprobs=[-0.1] * n, token_versions=[0] * n,
                  reward=reward, finish_reason="stop", token_rewards=token_rewards)


def group(gid, rewards, lengths=None, max_tokens=0):
    lengths = lengths or [3] * len(rewards)
    return RolloutGroup(group_id=gid, task_id=gid, samples=[sample(r, n) for r, n in zip(rewards, lengths)],
                        max_model_tokens=max_tokens)


def advantages(groups, norm, **kw):
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=len(groups), advantage_norm=norm, **kw)
    for g in groups:
        buf.add(g)
    return [[s.advantage for s in g.samples] for g in buf.take(step=1)]


def test_group_std_none_and_batch_std_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 1.5]]
    none = advantages([group(i, r) for i, r in enumerate(rewards)], "none")
    assert none == [[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]]
    grp = advantages([group(i, r) for i, r in enumerate(rewards)], "group_std")
    # group 0: unbiased std of (1, 0, 0, 1) = sqrt(1/3); group 1: of (.5, .5, .5, 1.5) = 0.5
    s3 = math.sqrt(3)
    assert np.allclose(grp[0], [0.5 * s3, -0.5 * s3, -0.5 * s3, 0.5 * s3], rtol=1e-5)
    assert np.allclose(grp[1], [-0.5, -0.5, -0.5, 1.5], rtol=1e-5)
    bat = advantages([group(i, r) for i, r in enumerate(rewards)], "batch_std")
    std = np.std([0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75])  # of every centred advantage of the batch
    assert np.allclose(bat, np.array(none) / std, rtol=1e-5)


@pytest.mark.parametrize("norm", ["none", "group_std", "batch_std"])
def test_equal_rewards_give_zero_advantages_under_every_norm(norm):
    assert advantages([group(0, [1.0] * 4), group(1, [0.0] * 4)], norm) == [[0.0] * 4, [0.0] * 4]
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=1, advantage="token_rtg", advantage_norm=norm)
    g = RolloutGroup(group_id=0, task_id=0, samples=[sample(1.0, token_rewards=[0.0, 0.0, 1.0]) for _ in range(3)])
    buf.add(g)
    assert all(not s.token_advantages.any() for s in buf.take(step=1)[0].samples)


def test_group_std_scales_token_advantages_too():
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=1, advantage="token_rtg", advantage_norm="group_std")
    g = RolloutGroup(group_id=0, task_id=0, samples=[sample(1.0, n=2, token_rewards=[0.0, 1.0]),
                                                     sample(0.0, n=2, token_rewards=[0.0, 0.0])])
    buf.add(g)
    s0, s1 = buf.take(step=1)[0].samples
    scale = 1 / (math.sqrt(0.5) + 1e-6)  # unbiased std of (1, 0)
    assert np.allclose(s0.token_advantages, [0.5 * scale, 0.5 * scale]) and s0.advantage == pytest.approx(0.5 * scale)
    assert np.allclose(s1.token_advantages, [-0.5 * scale, -0.5 * scale])


def test_overlong_penalty_is_dapos_soft_ramp():
    # L = 10, buffer 2: nothing up to 8 tokens, linear to -penalty at 10, -penalty beyond
    assert [overlong_penalty(n, 10, 2, 1.0) for n in (3, 8, 9, 10, 12)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(12, 10, 0, 1.0) == 0.0  # off
    assert Shaping(0.2, 2.0).penalty(9, 10) == -1.0  # buffer = 0.2 x 10 = 2 tokens, penalty 2


def test_overlong_shaping_enters_the_advantages():
    """Equal task rewards, one answer in the buffer: the shaped rewards differ, so do the advantages."""
    shaping = Shaping(0.2, 1.0)
    adv = advantages([group(0, [1.0, 1.0], lengths=[3, 9], max_tokens=10)], "none", shaping=shaping)
    assert adv == [[0.25, -0.25]]  # shaped rewards 1.0 and 0.5
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=1, shaping=shaping)
    g = group(0, [1.0, 1.0], lengths=[3, 9], max_tokens=10)
    buf.add(g)
    m = buf.sampling_metrics([g])
    assert m["overlong_penalty_mean"] == pytest.approx(-0.25) and m["overlong_frac"] == 0.5
    assert [s.reward for s in g.samples] == [1.0, 1.0]  # the task reward (reward_mean) is not changed


def test_dynamic_sampling_drops_zero_variance_groups_until_the_budget_is_spent():
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=2, dynamic_sampling=True, max_draws=2)
    assert buf.add(group(0, [1.0, 1.0])) is False  # zero variance: dropped, another is drawn
    assert buf.add(group(1, [1.0, 0.0])) is True
    assert buf.add(group(2, [0.0, 0.0])) is False
    assert buf.add(group(3, [0.0, 0.0])) is False
    assert buf.take(step=1) is None  # one usable group: keep drawing
    assert buf.add(group(4, [0.0, 0.0])) is True  # 5 > 2 x 2 draws for this batch: kept
    assert [g.group_id for g in buf.take(step=1)] == [1, 4]
    assert buf.sampling_metrics([]) == {"groups_dropped_zero_var_total": 3, "groups_kept_zero_var_total": 1}
    assert buf.add(group(5, [2.0, 2.0])) is False  # a new batch: a fresh budget
    off = RolloutBuffer(max_off_policy_steps=0, groups_per_step=2)
    assert off.add(group(0, [1.0, 1.0])) is True  # off by default
