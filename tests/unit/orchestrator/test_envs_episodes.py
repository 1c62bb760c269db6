"""Multi-turn episodes: exact-prefix histories, loss masks, routed rows, limits, no head-of-line blocking.

``FakeClient`` stands in for InferenceClient.generate (same GenerateResult). Its routing
row for position t is a pure function of (t, token at t), like a real engine with fixed
weights, so the rows a sample keeps from earlier turns can be checked against what a
later turn's response reports for the same positions.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from workers.common.inference_client import GenerateResult
from workers.orchestrator.batch_builder import build_batch_arrays
from workers.orchestrator.buffer import RolloutBuffer
from workers.orchestrator.envs.chat import ASSISTANT, BOS, EOT, TOOL, ByteTokenizer
from workers.orchestrator.episodes import env_batch_metrics, run_episode, run_episode_group
from tests.conftest import EchoEnv

LAYERS, TOPK = 2, 2
TOK = ByteTokenizer()


def routing_row(t: int, token: int) -> np.ndarray:
    return np.array([[(t + token + l) % 8, (t * 3 + l) % 8] for l in range(LAYERS)], dtype=np.uint8)


class FakeClient:
    """Scripted turns (list of text, or callable(call_index) -> text); records every input."""

    def __init__(self, turns, *, version=0, stop_early=False, delay_s=0.0):
        self.turns, self.version, self.stop_early, self.delay_s = turns, version, stop_early, delay_s
        self.inputs: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.log: list[tuple[str, float]] = []

    async def generate(self, input_ids, *, temperature, max_new_tokens, stop_token_ids=(), return_routed_experts=False,
                       rid=None, timeout_s=None):
        self.log.append((rid, time.monotonic()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        i = len(self.inputs)
        text = self.turns(i) if callable(self.turns) else self.turns[i % len(self.turns)]
        out = TOK.encode(text)[:max_new_tokens]
        finish = "length"
        if len(out) < max_new_tokens and not self.stop_early:
            out, finish = out + [EOT], "stop"
        self.inputs.append(list(input_ids))
        self.outputs.append(out)
        full = list(input_ids) + out
        routed = np.stack([routing_row(t, full[t]) for t in range(len(full) - 1)]) if return_routed_experts else None
        return GenerateResult(output_ids=out, output_logprobs=[-0.5 - 0.01 * j for j in range(len(out))],
                              token_versions=[self.version] * len(out), weight_version=self.version,
                              finish_reason=finish, routed_experts=routed, rid=rid, prompt_tokens=len(input_ids))


def episode(client, env, routed=True):
    return asyncio.run(run_episode(client, env, env.sample_task(), episode_id="e0", temperature=1.0,
                                   return_routed_experts=routed))


def test_history_is_an_exact_prefix_of_every_next_prompt():
    client = FakeClient(["abc", "de", "bye"])
    s = episode(client, EchoEnv())
    assert s.finish_reason == "done" and s.env_info["turns"] == 3
    for k in range(1, len(client.inputs)):
        prev = client.inputs[k - 1] + client.outputs[k - 1]
        assert client.inputs[k][: len(prev)] == prev, f"turn {k} prompt does not extend turn {k - 1}"
        obs = client.inputs[k][len(prev):]
        assert obs[0] == TOOL and obs[-1] == ASSISTANT and TOK.decode(obs).startswith("seen:")
    # the sample is exactly the last call's input + output; no trailing observation is kept
    assert s.prompt_ids + s.completion_ids == client.inputs[-1] + client.outputs[-1]
    assert s.prompt_ids == client.inputs[0] and s.prompt_ids[0] == BOS


def test_loss_mask_logprobs_versions_and_routing_line_up():
    client = FakeClient(["abc", "de", "bye"], version=3)
    s = episode(client, EchoEnv())
    mask = np.array(s.completion_mask)
    model_tokens = [t for out in client.outputs for t in out]
    assert [t for t, m in zip(s.completion_ids, mask) if m] == model_tokens
    assert len(s.completion_logprobs) == len(s.token_versions) == len(mask) == len(s.completion_ids)
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(s.completion_logprobs, s.token_versions, mask) if not m)
    assert all(lp < 0 and v == 3 for lp, v, m in zip(s.completion_logprobs, s.token_versions, mask) if m)
    full = s.prompt_ids + s.completion_ids
    assert s.routed_experts.shape == (len(full) - 1, LAYERS, TOPK)
    for t in range(len(full) - 1):
        np.testing.assert_array_equal(s.routed_experts[t], routing_row(t, full[t]))
    arrays = build_batch_arrays([run_group_of([s])], num_layers=LAYERS, top_k=TOPK)
    p = len(s.prompt_ids)
    np.testing.assert_array_equal(arrays["loss_mask"][0, p:p + len(mask)], mask)
    assert arrays["loss_mask"][0, :p].sum() == 0
    np.testing.assert_array_equal(arrays["routed_mask"][0, : len(full) - 1], 1)
    assert arrays["token_versions"][0][arrays["loss_mask"][0] == 0].max() == -1


def run_group_of(samples):
    from workers.orchestrator.buffer import RolloutGroup
    return RolloutGroup(group_id=0, task_id=0, samples=samples)


def test_turn_cut_by_length_is_closed_by_an_env_eot():
    client = FakeClient(["x" * 40], stop_early=True)
    s = episode(client, EchoEnv(max_turns=2))
    first_out = client.outputs[0]
    assert first_out[-1] != EOT and len(first_out) == 16
    obs = client.inputs[1][len(client.inputs[0]) + len(first_out):]
    assert obs[0] == EOT and obs[1] == TOOL  # the template closed the open turn, as an env token
    assert s.completion_mask[len(first_out)] == 0


def test_limits_end_the_episode_and_score_it_as_it_stands():
    env = EchoEnv(max_turns=2)
    s = episode(FakeClient(["a"]), env)
    assert s.finish_reason == "max_turns" and s.env_info["turns"] == 2
    assert s.reward == pytest.approx(0.25 * 2 + 0.5) and env.closed == 1
    s = episode(FakeClient(["y" * 15]), EchoEnv(max_episode_tokens=60))
    assert s.finish_reason == "max_tokens" and len(s.prompt_ids) + len(s.completion_ids) <= 60
    s = episode(FakeClient(["a"], delay_s=0.05), EchoEnv(episode_timeout_s=0.01))
    assert s.finish_reason == "timeout" and s.env_info["turns"] == 1


def test_slow_env_steps_do_not_block_generation_of_other_episodes():
    env = EchoEnv(step_delay_s=0.3, max_turns=2, max_concurrent_env_steps=1)
    client = FakeClient(["a"])
    t0 = time.monotonic()
    group = asyncio.run(run_episode_group(client, env, env.sample_task(), group_id=0, worker=0, num_samples=4,
                                          temperature=1.0, return_routed_experts=False, started_version=0))
    assert env.max_active_steps == 1  # the per-env limit held
    first_turns = [t for rid, t in client.log if rid.endswith("-t0")]
    assert max(first_turns) - t0 < 0.2, "every episode's first turn was generated before any env step finished"
    assert len(group.samples) == 4 and all(s.env_info["turns"] == 2 for s in group.samples)
    m = env_batch_metrics([group])
    assert m["env/echo/episode_turns_mean"] == 2 and m["env/echo/env_time_s_max"] >= 0.3
    assert m["env/echo/finish_max_turns_frac"] == 1.0


def multi_version_group(versions_per_turn):
    client = FakeClient(["ab", "cd", "bye"])
    orig = client.generate

    async def gen(input_ids, **kw):
        client.version = versions_per_turn[len(client.inputs)]
        return await orig(input_ids, **kw)

    client.generate = gen
    s = episode(client, EchoEnv(), routed=False)
    return run_group_of([s])


@pytest.mark.parametrize("policy", ["drop", "truncate", "keep"])
def test_long_episode_staleness_policies(policy):
    buf = RolloutBuffer(max_off_policy_steps=1, groups_per_step=1, long_episode_policy=policy)
    g = multi_version_group([0, 2, 3])  # turns sampled by versions 0, 2, 3; trained at step 4 (from version 3)
    before = sum(g.samples[0].completion_mask)
    buf.add(g)
    taken = buf.take(step=4)
    if policy == "drop":
        assert taken is None and buf.dropped_samples_total == 1
        return
    s = taken[0].samples[0]
    first_turn = len(TOK.encode("ab")) + 1
    if policy == "truncate":
        assert sum(s.completion_mask) == before - first_turn and buf.tokens_truncated_total == first_turn
        assert s.policy_version == 2
    else:
        assert sum(s.completion_mask) == before and buf.tokens_kept_stale_total == first_turn


def test_spare_groups_are_started_beyond_what_the_batches_need():
    from workers.orchestrator.buffer import groups_to_launch
    base = dict(next_step=1, weight_version=0, max_off=1, groups_per_step=4, buffered_usable=0, inflight_groups=6)
    assert groups_to_launch(**base) == 2
    assert groups_to_launch(**base, spare=3) == 5  # a long-tail group no longer holds the next batch back
    assert groups_to_launch(**{**base, "weight_version": -5}, spare=3) == 0  # nothing usable: no spares either


class IdsClient:
    """Answers each generate call with the next scripted token ids (and records the call)."""

    def __init__(self, answers, finish="stop"):
        self.answers, self.finish, self.calls = list(answers), finish, []

    async def generate(self, input_ids, *, temperature, max_new_tokens, stop_token_ids=(), return_routed_experts=False,
                       rid=None, timeout_s=None):
        self.calls.append(dict(input_ids=list(input_ids), max_new_tokens=max_new_tokens, stop=list(stop_token_ids)))
        out = self.answers[(len(self.calls) - 1) % len(self.answers)]
        full = list(input_ids) + out
        routed = np.stack([routing_row(t, full[t]) for t in range(len(full) - 1)]) if return_routed_experts else None
        return GenerateResult(output_ids=list(out), output_logprobs=[-0.1] * len(out), token_versions=[3] * len(out),
                              weight_version=3, finish_reason=self.finish, routed_experts=routed, rid=rid,
                              prompt_tokens=len(input_ids))


def test_single_turn_env_is_one_generate_call_scored_once():
    """reverse_digits through the one runner: the sample the single-turn path used to build
    (prompt, answer, env.score, env.token_rewards, routed rows), one call, no env metrics."""
    from workers.orchestrator.envs.reverse_digits import EOS, ReverseDigitsConfig, ReverseDigitsEnv
    env = ReverseDigitsEnv(ReverseDigitsConfig(min_digits=3, max_digits=3), seed=0)
    task = env.sample_task()
    right = list(task.target_ids) + [EOS]
    answers = [right, [right[0], 0, right[2], EOS], right + right[:2], [EOS]]
    client = IdsClient(answers)
    group = asyncio.run(run_episode_group(client, env, task, group_id=0, worker=0, num_samples=4, temperature=1.0,
                                          return_routed_experts=True, started_version=0))
    assert [c["input_ids"] for c in client.calls] == [list(task.prompt_ids)] * 4
    assert all(c["max_new_tokens"] == env.max_new_tokens and c["stop"] == [EOS] for c in client.calls)
    for s, ans in zip(group.samples, answers):
        assert s.prompt_ids == list(task.prompt_ids) and s.completion_ids == ans
        assert s.reward == env.score(task, ans) and s.token_rewards == env.token_rewards(task, ans)
        assert s.token_versions == [3] * len(ans) and s.routed_experts.shape[0] == len(task.prompt_ids) + len(ans) - 1
    assert [s.reward for s in group.samples][:2] == [1.0, pytest.approx(2 / 3)]
    assert group.env_metrics == {} and env_batch_metrics([group]) == {}
    group.assign_advantages("token_rtg")
    assert all(s.token_advantages is not None for s in group.samples)


def test_single_turn_aborted_answer_earns_nothing():
    from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig, ReverseDigitsEnv
    env = ReverseDigitsEnv(ReverseDigitsConfig(min_digits=3, max_digits=3), seed=0)
    task = env.sample_task()
    s = asyncio.run(run_episode(IdsClient([list(task.target_ids)], finish="abort"), env, task, episode_id="e",
                                temperature=1.0, return_routed_experts=False))
    assert s.finish_reason == "abort" and s.reward == 0.0 and s.token_rewards == [0.0, 0.0, 0.0]
