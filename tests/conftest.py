"""Helpers shared by every test tier: the config as the CLI composes it, plans and plan errors,
a canned nccl-tests table, an echo env. Imported as ``tests.conftest`` (tests is a package).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from launcher.config_store import register
from launcher.plan import JobPlan, PlanError, build_plan
from workers.common.config import RunConfig
from workers.orchestrator.envs.base import MultiTurnEnv, MultiTurnEnvConfig, StepResult
from workers.orchestrator.envs.chat import ChatTemplate

REPO = Path(__file__).resolve().parents[1]
register()  # the run schema and every registered entry's schema in Hydra's ConfigStore


# ---- from test_plan_slurm.py ------------------------------------------------------------
CONF_DIR = str(REPO / "hydra_conf")


TINY_SLURM = ["cluster=local_slurm"]


GLM5 = ["experiment=glm5_swe_28xh200", "cluster=h200_ib"]


def compose(overrides: list[str]) -> RunConfig:
    """The resolved RunConfig for these overrides, as the CLI composes it, planned as a dry run
    (``launcher.dry_run=true`` unless the overrides say otherwise: the GLM-5, Kimi K2 and Nemotron
    presets name families that only plan, refused when a run would start)."""
    if not any(o.startswith("launcher.dry_run=") for o in overrides):
        overrides = ["launcher.dry_run=true", *overrides]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides=overrides))


def plan(overrides: list[str]) -> JobPlan:
    return build_plan(compose(overrides))


def plan_error(overrides: list[str]) -> str:
    with pytest.raises(PlanError) as e:
        plan(overrides)
    return str(e.value)




# ---- from test_preflight_nccl_parse.py ------------------------------------------------------------
HEADER = """\
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""


BANNER = """\
# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
""" + "".join(f"#  Rank {r:2d} Group  0 Pid {4100 + r:6d} on gpu-{r // 8:03d} device  {r % 8} [0x{0x18 + r % 8:02x}] NVIDIA H200\n"
              for r in range(16)) + "#\n"


ALL_REDUCE = BANNER + HEADER + """\
     1048576        262144     float     sum      -1    48.31   21.71   40.70      0    47.95   21.87   41.00      0
     4194304       1048576     float     sum      -1    81.02   51.77   97.07      0    80.66   52.00   97.50      0
    16777216       4194304     float     sum      -1    172.4   97.31  182.46      0    171.9   97.60  183.00      0
    67108864      16777216     float     sum      -1    404.9  165.74  310.77      0    403.8  166.19  311.61      0
   268435456      67108864     float     sum      -1   1281.6  209.45  392.72      0   1279.0  209.88  393.52      0
  1073741824     268435456     float     sum      -1   4911.3  218.63  409.93      0   4905.2  218.90  410.44      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 237.1492
#
# Collective test concluded: all_reduce_perf
"""




# ---- from test_envs_episodes.py ------------------------------------------------------------
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


