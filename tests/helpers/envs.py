"""A scripted multi-turn env for the episode and batch tests."""
from __future__ import annotations

import asyncio

from workers.orchestrator.envs.base import MultiTurnEnv, MultiTurnEnvConfig, StepResult
from workers.orchestrator.envs.chat import ChatTemplate


class EchoEnv(MultiTurnEnv):
    """Observation = 'seen:<turn text>'; done when the model says 'bye'; reward 0.25 per step."""

    name = "echo"

    def __init__(self, step_delay_s=0.0, **kw):
        cfg = MultiTurnEnvConfig(name="echo", **{"max_turns": 4, "max_new_tokens_per_turn": 16, "max_episode_tokens": 400, **kw})
        super().__init__(cfg, seed=0)
        self.template = ChatTemplate()
        self.stop_token_ids = self.template.stop_token_ids
        self.step_delay_s = step_delay_s
        self.closed = 0
        self.active_steps = self.max_active_steps = 0

    def sample_task(self):
        return type("T", (), {"task_id": 1})()

    def session(self, task, episode_id):
        env = self

        class S:
            async def reset(self):
                return env.template.prompt_ids([{"role": "user", "content": "hi"}])

            async def step(self, turn_ids):
                async with env.step_slots:
                    env.active_steps += 1
                    env.max_active_steps = max(env.max_active_steps, env.active_steps)
                    await asyncio.sleep(env.step_delay_s)
                    env.active_steps -= 1
                text = env.template.turn_text(turn_ids)
                return StepResult(env.template.observation_ids(turn_ids, "seen:" + text), reward=0.25,
                                  done="bye" in text, info={"tool": "echo"})

            async def final_reward(self):
                return 0.5

            async def close(self):
                env.closed += 1

        return S()
