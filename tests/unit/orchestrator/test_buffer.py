"""Staleness window, launch budget and advantages of the orchestrator's buffer."""
import numpy as np
import pytest

from workers.orchestrator.batch_builder import batch_metrics, build_batch_arrays
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, Sample, groups_to_launch


def sample(version, reward=0.5, n=3, token_rewards=None, prompt=(1, 4, 5, 2)):
    return Sample(prompt_ids=list(prompt), completion_ids=[5, 4, 3][:n], completion_logprobs=[-0.1] * n,
                  token_versions=[version] * n, reward=reward, finish_reason="stop", token_rewards=token_rewards)


def group(gid, version, rewards=(0.0, 1.0)):
    return RolloutGroup(group_id=gid, task_id=gid, samples=[sample(version, r) for r in rewards])


def test_stale_groups_are_dropped_and_counted():
    buf = RolloutBuffer(max_off_policy_steps=1, groups_per_step=2)
    for gid, v in enumerate([0, 1, 2, 2]):
        buf.add(group(gid, v))
    batch = buf.take(step=3)  # step 3 trains version 2: version 0 is 2 steps old > 1
    assert [g.group_id for g in batch] == [1, 2]
    assert buf.dropped_samples_total == 2
    assert buf.take(step=3) is None  # one group left, two needed


def test_synchronous_window_keeps_only_current_version():
    buf = RolloutBuffer(max_off_policy_steps=0, groups_per_step=1)
    buf.add(group(0, 3))
    buf.add(group(1, 4))
    assert [g.group_id for g in buf.take(step=5)] == [1]  # step 5 trains version 4
    assert buf.dropped_samples_total == 2


def test_policy_version_is_oldest_token():
    s = sample(5)
    s.token_versions = [5, 6, 6]
    assert s.policy_version == 5


@pytest.mark.parametrize("kw, want", [
    (dict(next_step=1, weight_version=0, max_off=0, groups_per_step=4, buffered_usable=0, inflight_groups=0), 4),
    (dict(next_step=2, weight_version=0, max_off=0, groups_per_step=4, buffered_usable=0, inflight_groups=0), 0),
    (dict(next_step=1, weight_version=0, max_off=2, groups_per_step=4, buffered_usable=3, inflight_groups=2), 7),
    (dict(next_step=6, weight_version=4, max_off=2, groups_per_step=4, buffered_usable=0, inflight_groups=9), 0),
])
def test_launch_budget_only_starts_usable_groups(kw, want):
    assert groups_to_launch(**kw) == want


def test_sequence_advantages_are_group_relative():
    g = group(0, 0, rewards=(0.0, 0.5, 1.0))
    g.assign_advantages("sequence")
    assert [s.advantage for s in g.samples] == pytest.approx([-0.5, 0.0, 0.5])


def test_token_reward_to_go_advantages():
    a = sample(0, reward=1.0, token_rewards=[0.5, 0.5, 0.0])
    b = sample(0, reward=0.5, token_rewards=[0.0, 0.5, 0.0])
    g = RolloutGroup(group_id=0, task_id=0, samples=[a, b])
    g.assign_advantages("token_rtg")
    # reward-to-go a = [1, .5, 0], b = [.5, .5, 0]; baseline = [.75, .5, 0]
    assert a.token_advantages.tolist() == pytest.approx([0.25, 0.0, 0.0])
    assert b.token_advantages.tolist() == pytest.approx([-0.25, 0.0, 0.0])


def test_batch_arrays_align_tokens_logprobs_and_versions():
    g = group(0, 2)
    g.assign_advantages("sequence")
    g.samples[1].completion_ids = [6]
    g.samples[1].completion_logprobs = [-2.0]
    g.samples[1].token_versions = [3]
    arr = build_batch_arrays([g], num_layers=4, top_k=2)
    assert arr["input_ids"].shape == (2, 7)
    assert arr["input_ids"][1].tolist() == [1, 4, 5, 2, 6, 0, 0]
    assert arr["loss_mask"][1].tolist() == [0, 0, 0, 0, 1, 0, 0]
    assert arr["inference_logprobs"][1, 4] == np.float32(-2.0)
    assert arr["token_versions"][1].tolist() == [-1, -1, -1, -1, 3, -1, -1]
    assert arr["advantages"].shape == (2,)
    assert "routed_experts" not in arr  # no sample carried routing
    m = batch_metrics(4, [g])  # step 4 trains version 3
    assert m["max_staleness"] == 1 and m["policy_version_min"] == 2 and m["policy_version_max"] == 3


def test_routed_experts_travel_as_binary_rows():
    g = group(0, 0)
    for s in g.samples:
        s.routed_experts = np.arange(6 * 4 * 2, dtype=np.uint8).reshape(6, 4, 2) % 8  # prompt 4 + completion 3 - 1
    arr = build_batch_arrays([g], num_layers=4, top_k=2)
    assert arr["routed_experts"].dtype == np.uint8 and arr["routed_experts"].shape == (2, 7, 4, 2)
    assert arr["routed_mask"][0].tolist() == [1, 1, 1, 1, 1, 1, 0]  # last sampled token has no routing
