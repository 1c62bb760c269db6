"""A 131,072-token multi-turn episode, token in / token out: what the model saw is what is trained.

The mission's episodes reach env.max_episode_tokens = 131072 (the large presets' limit). Long tool
outputs push an episode to the limit; the runner (workers/orchestrator/episodes.py) must never
re-tokenize between turns, stop at the budget (the last turn's max_new_tokens is what is left,
finish "max_tokens", scored as it stands), and the batch the trainer loads from disk
(orchestrator batch_builder -> safetensors -> workers/trainer/batch.py) must hold exactly the
tokens of the last generate call's input + output, with loss, log-probs, versions and routing
rows on the positions the engine produced them for.
"""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from tests.conftest import EchoEnv
from tests.unit.orchestrator.test_envs_episodes import LAYERS, TOPK, FakeClient, routing_row
from workers.common.protocol import RunPaths
from workers.orchestrator.buffer import RolloutGroup
from workers.orchestrator.envs.base import StepResult
from workers.orchestrator.episodes import run_episode
from workers.orchestrator.batch_builder import write_batch
from workers.trainer.batch import load_batch
from workers.trainer.packing import plan_packing

LIMIT = 131072


class LongToolEnv(EchoEnv):
    """Every step returns a 30,000-byte tool output (one token per byte): a few turns reach the limit."""

    name = "long_tool"

    def session(self, task, episode_id):
        inner, env = super().session(task, episode_id), self

        class S:
            reset, final_reward, close = inner.reset, inner.final_reward, inner.close

            async def step(self, turn_ids):
                text = "out:" + "x" * 30000
                return StepResult(env.template.observation_ids(turn_ids, text), reward=0.1, done=False)

        return S()


def test_a_131072_token_episode_trains_exactly_the_tokens_the_model_saw(tmp_path):
    env = LongToolEnv(max_turns=50, max_new_tokens_per_turn=4096, max_episode_tokens=LIMIT)
    client = FakeClient(lambda i: "patch " * 600)  # 3600-token turns, each closed by the model's EOT
    s = asyncio.run(run_episode(client, env, env.sample_task(), episode_id="e0", temperature=1.0,
                                return_routed_experts=True))
    full = s.prompt_ids + s.completion_ids
    assert s.finish_reason == "max_tokens" and LIMIT - 4096 - 30100 < len(full) <= LIMIT
    assert len(client.inputs) >= 4
    for k in range(1, len(client.inputs)):  # token in / token out: each prompt extends the last one exactly
        prev = client.inputs[k - 1] + client.outputs[k - 1]
        assert client.inputs[k][: len(prev)] == prev
    assert full == client.inputs[-1] + client.outputs[-1]  # the sample is what the last call saw and said

    paths = RunPaths(tmp_path)
    write_batch(paths, 1, [RolloutGroup(group_id=0, task_id=0, samples=[s])], num_layers=LAYERS, top_k=TOPK,
                temperature=1.0, extra_metrics={})
    batch = load_batch(paths.rollouts(1), step=1, num_layers=LAYERS, top_k=TOPK, num_experts=8)
    n = len(full)
    assert batch.input_ids.shape[1] >= n and int(batch.attention_mask.sum()) == n
    assert batch.input_ids[0, :n].tolist() == full  # the trained row is the tokens the engine saw, bit for bit
    sampled = np.zeros(n, dtype=bool)
    logprobs = np.zeros(n, dtype=np.float32)
    offset = 0
    for inp, out in zip(client.inputs, client.outputs):  # where each call's output sits in the row
        offset = len(inp)
        sampled[offset:offset + len(out)] = True
        logprobs[offset:offset + len(out)] = [-0.5 - 0.01 * j for j in range(len(out))]
    assert torch.equal(batch.loss_mask[0, :n], torch.from_numpy(sampled))
    np.testing.assert_allclose(batch.inference_logprobs[0, :n].numpy(), logprobs)
    rows = np.stack([routing_row(t, full[t]) for t in range(n - 1)])
    np.testing.assert_array_equal(batch.routed_experts[0, : n - 1].numpy(), rows)
    p = plan_packing(batch.attention_mask)  # the trainer's packed forward reads the same tokens
    assert torch.equal(p.unpack(p.pack(batch.input_ids))[0, :n], batch.input_ids[0, :n])
