"""Evaluation during training (workers/orchestrator/evaluation.py): greedy answers on the eval split,
eval/* metrics handed to the next batch once, when evals are due; reward metrics of a batch; sample
logs; and one step numbering on the console, in the trainer log and in metrics.jsonl."""
from __future__ import annotations

import asyncio
import json
import logging

from launcher.progress import format_eval, format_step
from workers.common.inference_client import GenerateResult
from workers.orchestrator.envs.chat import EOT, ByteTokenizer
from workers.orchestrator.envs.dataset import DatasetConfig, DatasetEnv
from workers.orchestrator.buffer import RolloutGroup, Sample
from workers.orchestrator.evaluation import Evaluator, log_samples, pick_samples, reward_metrics
from workers.orchestrator.episodes import run_episode_group
from workers.trainer.metrics import progress_line

TOK = ByteTokenizer()


class fake_client:
    """Speaks InferenceClient.generate: answers every prompt with ``answer`` and records the temperatures."""

    def __init__(self, answer: str, version: int = 3):
        self.answer, self.version, self.temperatures = answer, version, []

    async def generate(self, input_ids, *, temperature, max_new_tokens, stop_token_ids=(), return_routed_experts=False,
                       rid=None, timeout_s=None):
        self.temperatures.append(temperature)
        ids = [*TOK.encode(self.answer), EOT][:max_new_tokens]
        return GenerateResult(output_ids=ids, output_logprobs=[-0.1] * len(ids), token_versions=[self.version] * len(ids),
                              weight_version=self.version, finish_reason="stop", rid=rid)


def make_env(tmp_path, reward_fn="exact_match") -> DatasetEnv:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+0", "answer": "1" if i % 2 else "0"}) + "\n" for i in range(8)))
    return DatasetEnv(DatasetConfig(path=str(f), eval_fraction=0.5, reward_fn=reward_fn), seed=0)


def test_eval_runs_greedy_on_the_eval_split_and_reports_once(tmp_path, caplog):
    env = make_env(tmp_path)
    log = logging.getLogger("test.eval")
    ev = Evaluator(env, every=2, num_samples=3, log=log)
    client = fake_client("1")

    async def go():
        ev.maybe_start(client, 0)
        assert ev.take_result() == {}  # not finished yet: nothing for this batch
        await ev.task
        first = ev.take_result()
        ev.maybe_start(client, 1)  # not due: 1 < 0 + 2
        assert ev.task is None
        ev.maybe_start(client, 2)
        await ev.task
        return first, ev.take_result(), ev.take_result()

    with caplog.at_level(logging.INFO, logger="test.eval"):
        first, second, none = asyncio.run(go())
    expected = sum(t.sample["answer"] == "1" for t in env.eval_tasks(3)) / 3
    assert first == {"eval/reward": expected, "eval/num_samples": 3, "eval/aborted": 0, "eval/policy_version": 3,
                     "eval/weights_step": 0, "eval/reward_failures": 0, "eval/reward_timeouts": 0,
                     "eval/reward_calls": 3, "eval/reward_failure_frac": 0.0, "eval/pass@1": expected}
    assert second["eval/reward"] == expected and none == {}
    assert client.temperatures == [0.0] * 6  # greedy, 3 samples x 2 evals
    assert "eval at weights 3: reward" in caplog.text and "completion: 1" in caplog.text


class alternating_client(fake_client):
    """Answers "1" and "0" in turn, so each record's k samples hold both answers."""

    async def generate(self, input_ids, **kw):
        self.answer = "0" if self.answer == "1" else "1"
        return await super().generate(input_ids, **kw)


def test_pass_at_k_samples_k_answers_per_record(tmp_path):
    env = make_env(tmp_path)
    ev = Evaluator(env, every=1, num_samples=4, log=logging.getLogger("t.passk"), k=2, temperature=0.7)
    client = alternating_client("0")

    async def go():
        ev.maybe_start(client, 0)
        await ev.task
        return ev.take_result()

    out = asyncio.run(go())
    assert client.temperatures == [0.7] * 8 and out["eval/num_samples"] == 8
    # every record got one "1" and one "0": exactly one of its two answers is right
    assert out["eval/pass@1"] == 0.5 and out["eval/pass@2"] == 1.0 and out["eval/reward"] == 0.5


def test_reward_metrics_and_sample_logs_of_a_batch(tmp_path, caplog):
    (tmp_path / "named_rw.py").write_text(
        "def ok(p, c, s):\n    return 1.0\n\ndef bad(p, c, s):\n    raise ValueError('nope')\n\nR = {'ok': ok, 'bad': bad}\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        env = make_env(tmp_path, reward_fn="named_rw:R")
        task = env.sample_task()
        with caplog.at_level(logging.INFO):
            group = asyncio.run(run_episode_group(fake_client("7"), env, task, group_id=0, worker=0, num_samples=2,
                                                  temperature=1.0, return_routed_experts=False, started_version=0))
            log_samples(logging.getLogger("test.samples"), env, 5, [group])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("named_rw", None)
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert reward_metrics(group.samples) == {"reward_failures": 2, "reward_timeouts": 0, "reward_calls": 4,
                                             "reward_failure_frac": 0.5, "reward/bad": 0.0, "reward/ok": 1.0}
    assert "reward failed for" in caplog.text and "bad: raised ValueError: nope" in caplog.text
    assert "step 5 sample (best): reward 1.000 | prompt: " in caplog.text and "completion: 7" in caplog.text
    assert env.metrics()["data/drawn"] == 1


def test_logged_samples_span_the_rewards_best_first(caplog):
    """orchestrator.num_logged_samples: evenly spaced reward ranks, best first; rows for the step's record."""
    def sample(reward, completion):
        return Sample(prompt_ids=[1, 2], completion_ids=completion, completion_logprobs=[-0.1] * len(completion),
                      token_versions=[0] * len(completion), reward=reward, finish_reason="stop")

    samples = [sample(r / 10, [r]) for r in (3, 9, 0, 5, 7, 1, 4)]
    assert [(label, s.reward) for label, s in pick_samples(samples, 3)] == [("best", 0.9), ("rank 4", 0.4),
                                                                            ("worst", 0.0)]
    assert [s.reward for _, s in pick_samples(samples, 1)] == [0.9]
    assert len(pick_samples(samples, 64)) == 7 and pick_samples([], 2) == []
    env = type("Env", (), {"text": staticmethod(lambda ids: " ".join(map(str, ids)))})()
    with caplog.at_level(logging.INFO):
        rows = log_samples(logging.getLogger("test.pick"), env, 4, [RolloutGroup(0, 0, samples)], 2)
    assert rows == [{"rank": "best", "reward": 0.9, "prompt": "1 2", "completion": "9"},
                    {"rank": "worst", "reward": 0.0, "prompt": "1 2", "completion": "0"}]
    assert "step 4 sample (best): reward 0.900 | prompt: 1 2 | completion: 9" in caplog.text


def test_console_trainer_log_and_metrics_use_one_step_number():
    rec = {"step": 4, "reward_mean": 0.5, "eval/reward": 0.25, "eval/weights_step": 2}
    assert format_step(rec, 4).startswith("step   4/4 | reward 0.500 | stale max")
    assert format_eval(rec, 4) == "step   2/4 eval | reward 0.250 (weights of step 2, reported at step 4)"
    assert progress_line(rec, 4).startswith("step   4/4 | loss")


def test_slurmrl_eval_refuses_what_it_cannot_evaluate(tmp_path, capsys):
    from omegaconf import OmegaConf

    from workers.common.protocol import RunPaths
    from workers.orchestrator.evaluate_step import main

    assert main([str(tmp_path)]) == 2 and "is not a published step directory" in capsys.readouterr().err
    paths = RunPaths(tmp_path / "run").ensure()
    step = paths.weights(4)
    step.mkdir(parents=True)
    assert main([str(step)]) == 2 and "has no STABLE marker" in capsys.readouterr().err
    (step / "STABLE").write_text("")
    assert main([str(step)]) == 2 and "config/run.yaml is missing" in capsys.readouterr().err
    from tests.conftest import compose

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(compose(
        ["env=dataset", f"env.path={data}", "env.reward_fn=not_on_the_path_rewards:score", "env.eval_fraction=0.5"]))))
    err = (main([str(step)]), capsys.readouterr().err)
    assert err[0] == 2 and err[1].startswith("slurmrl-eval: error: the run's env=dataset cannot be made here: ")
    assert "not_on_the_path_rewards" in err[1] and "PYTHONPATH=" in err[1] and "Traceback" not in err[1]
    assert len(err[1].strip().splitlines()) == 1
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(compose(["env=dataset", f"env.path={data}"]))))
    assert main([str(step)]) == 2 and "has no eval split: it set neither" in capsys.readouterr().err


def test_every_built_in_generated_env_has_a_fixed_eval_split_that_leaves_training_alone():
    from workers.common.registry import ENVS
    from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig, ReverseDigitsEnv

    assert all(ENVS.get(name).eval_split for name in ("reverse_digits", "reverse_text", "code_repair", "swe",
                                                      "dataset", "mix", "target"))
    env, fresh = ReverseDigitsEnv(ReverseDigitsConfig(), seed=0), ReverseDigitsEnv(ReverseDigitsConfig(), seed=0)
    first = [env.sample_task() for _ in range(3)]
    evals = env.eval_tasks(4)
    assert env.eval_tasks(4) == evals and len(evals) == 4  # the same tasks at every evaluation
    assert all(t.task_id >= 1_000_000_000 for t in evals)
    assert [env.sample_task() for _ in range(3)] == [fresh.sample_task() for _ in range(6)][3:]  # stream untouched
    assert first[0] != evals[0]
