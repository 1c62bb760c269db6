"""env=mix (workers/orchestrator/envs/mix.py): entries checked by their own envs (errors named
env.envs.<label>), a seeded weighted draw that replays exactly, episodes run by the entry's env,
per-entry batch metrics and per-entry eval rewards."""
from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.unit.orchestrator.test_evaluation import fake_client
from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.dataset import DatasetEnv
from workers.orchestrator.envs.mix import MixConfig
from workers.orchestrator.envs.reverse_digits import ReverseDigitsEnv
from workers.orchestrator.episodes import env_batch_metrics, run_episode_group
from workers.orchestrator.evaluation import Evaluator


def _plan_error(overrides: list[str]) -> str:
    with pytest.raises(PlanError) as e:
        build_plan(compose(overrides))
    return str(e.value)


def test_plan_checks_every_entry_with_its_own_env():
    cfg = compose(["env=mix", "env.weights.long=3.0"])
    assert type(cfg.env) is MixConfig and build_plan(cfg).roles
    assert "env.envs.long: model.max_position_embeddings(64) < longest episode" in _plan_error(
        ["env=mix", "env.envs.long.max_digits=60"])
    assert "env.envs.long: env.path is not used by environment 'reverse_digits'" in _plan_error(
        ["env=mix", "+env.envs.long.path=/x"])
    assert "env.weights has 0.0: each item must be > 0" in _plan_error(["env=mix", "env.weights.short=0"])
    assert "must be env.envs labels" in _plan_error(["env=mix", "+env.weights.third=1.0"])
    assert "env.envs.long: env.name='nope' is not a known environment" in _plan_error(["env=mix", "env.envs.long.name=nope"])
    assert build_plan(compose(["env=mix", "orchestrator.eval_every_steps=2"])).roles  # generated entries have one


def mixed(tmp_path, seed=0):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": str(i), "answer": str(i)}) + "\n" for i in range(10)))
    cfg = MixConfig(weights={"digits": 3.0, "echo": 1.0}, envs={
        "digits": {"name": "reverse_digits", "min_digits": 2, "max_digits": 3},
        "echo": {"name": "dataset", "path": str(data), "max_new_tokens": 4, "eval_fraction": 0.2}})
    return make_env(cfg, seed=seed)


def test_weighted_seeded_draw_replays_and_resolves_to_the_entry(tmp_path):
    env = mixed(tmp_path)
    tasks = [env.sample_task() for _ in range(200)]
    counts = Counter(t.label for t in tasks)
    assert 120 < counts["digits"] < 180 and counts["digits"] + counts["echo"] == 200  # ~3:1
    again = mixed(tmp_path)
    assert [again.sample_task().task_id for _ in range(200)] == [t.task_id for t in tasks]
    sub, inner = env.resolve(next(t for t in tasks if t.label == "echo"))
    assert isinstance(sub, DatasetEnv) and inner.task_id.count(":") == 2
    digits = next(t for t in tasks if t.label == "digits")
    assert isinstance(env.resolve(digits)[0], ReverseDigitsEnv) and env.resolve(digits)[1] is digits.inner
    assert env.metrics()["env/digits/tasks_drawn_total"] == counts["digits"]
    assert env.metrics()["env/echo/data/drawn"] == counts["echo"]


def test_groups_are_tagged_per_entry_and_evaluated_per_entry(tmp_path):
    env = mixed(tmp_path)
    client = fake_client("5")
    groups = []
    for gid in range(6):
        task = env.sample_task()
        sub, inner = env.resolve(task)
        groups.append(asyncio.run(run_episode_group(client, sub, inner, group_id=gid, worker=0, num_samples=2,
                                                    temperature=1.0, return_routed_experts=False, started_version=0,
                                                    env_tag=task.label)))
    metrics = env_batch_metrics(groups)
    for label in {g.env_metrics["env"] for g in groups}:
        assert f"env/{label}/reward_mean" in metrics and f"env/{label}/episode_turns_mean" in metrics
    ev = Evaluator(env, every=1, num_samples=5, log=logging.getLogger("t.mix"))

    async def go():
        ev.maybe_start(fake_client("5"), 0)
        await ev.task
        return ev.take_result()

    out = asyncio.run(go())
    assert out["eval/num_samples"] == 2 + 5 and "eval/echo/reward" in out and "eval/digits/reward" in out
