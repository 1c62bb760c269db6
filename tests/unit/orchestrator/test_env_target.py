"""env=target (workers/orchestrator/envs/target.py): a user's env class by import path, from a
package outside the repository (a temp dir on sys.path), by override or by a YAML of the user's own
(hydra.searchpath); every mistake refused at plan time with the key named."""
from __future__ import annotations

import sys

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from workers.common.config import conform_sections
from workers.orchestrator.envs import make_env

USER_ENVS = '''
import random
from dataclasses import dataclass

from workers.orchestrator.envs.base import MultiTurnEnv, SingleTurnEnv, StepResult


@dataclass(frozen=True)
class Task:
    task_id: int
    prompt_ids: tuple
    target: int


class FirstDigit(SingleTurnEnv):
    """Answer with the prompt's first digit (ids 4..13), then stop (3)."""
    vocab_size = 14

    def __init__(self, *, seed, length=3):
        self.rng, self.length, self.n = random.Random(seed), length, 0
        self.max_new_tokens, self.stop_token_ids = 2, (3,)

    def sample_task(self):
        digits = [4 + self.rng.randrange(10) for _ in range(self.length)]
        self.n += 1
        return Task(self.n, (1, *digits, 2), digits[0])

    def score(self, task, completion_ids):
        return float(bool(completion_ids) and completion_ids[0] == task.target)


class Echo(MultiTurnEnv):
    """Two turns: the env echoes the model's turn back once."""
    vocab_size = 14

    def __init__(self, cfg, *, seed, model=None):
        super().__init__(cfg, seed=seed)
        self.model_name, self.n = model.name, 0

    def sample_task(self):
        self.n += 1
        return Task(self.n, (1, 4, 2), 4)

    def session(self, task, episode_id):
        return EchoSession(task)


class EchoSession:
    def __init__(self, task):
        self.task, self.turns = task, 0

    async def reset(self):
        return list(self.task.prompt_ids)

    async def step(self, turn_ids):
        self.turns += 1
        return StepResult(observation_ids=list(turn_ids), reward=0.5, done=self.turns == 2)

    async def final_reward(self):
        return 0.0

    async def close(self):
        pass


class Undeclared(SingleTurnEnv):
    def sample_task(self):
        return None

    def score(self, task, completion_ids):
        return 0.0


class NoScore(SingleTurnEnv):
    vocab_size = 14

    def sample_task(self):
        return None


NOT_A_CLASS = 3
'''


@pytest.fixture
def user_pkg(tmp_path):
    """``h21_envs`` (the user's module) and ``conf/env/first_digit.yaml`` (the user's config dir)."""
    (tmp_path / "h21_envs.py").write_text(USER_ENVS)
    conf = tmp_path / "conf" / "env"
    conf.mkdir(parents=True)
    (conf / "first_digit.yaml").write_text("_target_: h21_envs:FirstDigit\nargs: {length: 2}\n")
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("h21_envs", None)


def planned(overrides):
    cfg = conform_sections(compose(overrides))  # as the CLI does (launcher/__main__.py)
    build_plan(cfg)
    return cfg


def error(overrides) -> str:
    with pytest.raises(PlanError) as e:
        planned(overrides)
    return str(e.value)


def test_a_user_env_by_override_and_by_own_yaml_is_built(user_pkg):
    cfg = planned(["env=target", "env._target_=h21_envs.FirstDigit", "+env.args.length=4"])
    env = make_env(cfg.env, seed=3, model=cfg.model)
    task = env.sample_task()
    assert type(env).__name__ == "FirstDigit" and len(task.prompt_ids) == 6 and task.task_id == 1
    assert env.score(task, [task.target, 3]) == 1.0
    cfg = planned([f"hydra.searchpath=[file://{user_pkg / 'conf'}]", "env=first_digit"])  # no name: _target_ says it
    assert cfg.env.name == "target" and cfg.env.args == {"length": 2}
    assert len(make_env(cfg.env, seed=0, model=cfg.model).sample_task().prompt_ids) == 4
    cfg = planned(["env=target", "env._target_=h21_envs:Echo", "env.max_episode_tokens=32",
                   "env.max_new_tokens_per_turn=4"])
    echo = make_env(cfg.env, seed=0, model=cfg.model)  # cfg= and model= passed where __init__ takes them
    assert echo.limits.max_turns == 4 and echo.model_name == cfg.model.name


def test_a_target_on_another_env_points_at_env_target():
    """``+env._target_=...`` on the default env (reverse_digits) is refused with the way to do it."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from launcher.config_store import reject_unknown_keys
    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = hydra_compose("config", overrides=["+env._target_=my_pkg.envs:MyEnv"])
    with pytest.raises(KeyError, match=r"env._target_ is not a config key \(an env class of your own: env=target "):
        reject_unknown_keys(cfg)


@pytest.mark.parametrize("overrides, message", [
    ([], "env._target_ is required with env=target"),
    (["env._target_=nope_module:Env"], "cannot import module 'nope_module'"),
    (["env._target_=h21_envs:Missing"], "has no attribute 'Missing'"),
    (["env._target_=h21_envs:NOT_A_CLASS"], "is a int, not a class"),
    (["env._target_=h21_envs:Task"], "Task must subclass SingleTurnEnv or MultiTurnEnv"),
    (["env._target_=h21_envs:NoScore"], r"NoScore \(SingleTurnEnv\) does not implement \['score'\]"),
    (["env._target_=h21_envs:Undeclared"], "must declare the class attribute vocab_size"),
    (["env._target_=h21_envs:FirstDigit", "+env.args.depth=2"], "got an unexpected keyword argument 'depth'"),
    (["env._target_=h21_envs:FirstDigit", "model.vocab_size=8"], r"model.vocab_size\(8\) is smaller than env target"),
    (["env._target_=h21_envs:FirstDigit", "orchestrator.eval_every_steps=2"], "has no eval split: write eval_tasks"),
    (["env._target_=h21_envs:Echo"], r"env.max_episode_tokens\(512\) > model.max_position_embeddings"),
    (["env._target_='not a path'"], "must be an import path like my_package.envs:MyEnv"),
])
def test_plan_refuses_a_bad_user_env_naming_the_key(user_pkg, overrides, message):
    import re

    assert re.search(message, error(["env=target", *overrides]))
