"""env=dataset (workers/orchestrator/envs/dataset.py, envs/data.py): loading jsonl files and shard
directories, templates, bad input named by file and line, the eval split, the byte-level chat
prompt, plan-time refusals, and a replayed data order that resumes exactly where it stopped."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from workers.orchestrator.envs import data, make_env
from workers.orchestrator.envs.chat import ASSISTANT, BOS, EOT, USER, ByteTokenizer
from workers.orchestrator.envs.dataset import DatasetConfig, DatasetEnv

BYTES = ["model.vocab_size=264", "model.max_position_embeddings=128", "env.max_new_tokens=8"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(start, start + n)]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A reward module outside the repository, on sys.path (as PYTHONPATH would put it)."""
    (tmp_path / "byot_rewards.py").write_text(
        "def score(prompt, completion, sample):\n    return float(completion == sample['answer'])\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "byot_rewards"
    sys.modules.pop("byot_rewards", None)


def test_jsonl_file_and_shard_directory_load_in_order(tmp_path):
    f = write_jsonl(tmp_path / "one.jsonl", rows(3))
    recs = data.load_records(str(f))
    assert [r.fields["answer"] for r in recs] == ["1", "2", "3"] and recs[2].where == f"{f} line 3"
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-1.jsonl", rows(2, start=10))
    write_jsonl(shards / "part-0.jsonl", rows(2))
    (shards / "README.txt").write_text("not data")
    assert [r.fields["answer"] for r in data.load_records(str(shards))] == ["1", "2", "11", "12"]


@pytest.mark.parametrize("make, match", [
    (lambda d: "", "env.path is required"),
    (lambda d: "relative/train.jsonl", "must be an absolute path"),
    (lambda d: str(d / "missing.jsonl"), "does not exist"),
    (lambda d: str((d / "empty.jsonl").write_text("\n\n") and d / "empty.jsonl"), "holds no records"),
    (lambda d: str((d / "bad.jsonl").write_text('{"a": 1}\n{oops\n') and d / "bad.jsonl"), r"bad.jsonl line 2 is not valid JSON"),
    (lambda d: str((d / "list.jsonl").write_text('[1, 2]\n') and d / "list.jsonl"), "line 1 is a JSON list"),
    (lambda d: str((d / "t.csv").write_text("a\n") and d / "t.csv"), "unsupported file type '.csv'"),
    (lambda d: str((d / "emptydir").mkdir() or d / "emptydir"), "directory without .jsonl or .parquet"),
])
def test_bad_sources_are_named(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        data.load_records(make(tmp_path))


def test_parquet_needs_pyarrow_or_says_how_to_install(tmp_path):
    f = tmp_path / "t.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        f.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="pip install pyarrow"):
            data.load_records(str(f))
        return
    pq.write_table(pa.Table.from_pylist(rows(2)), str(f))
    assert [r.fields["question"] for r in data.load_records(str(f))] == ["0+1", "1+1"]


def test_a_row_missing_a_key_is_named_with_file_and_line(tmp_path, reward_module):
    f = write_jsonl(tmp_path / "train.jsonl", [*rows(2), {"q": "x", "answer": "1"}])
    msg = _plan_error(["env=dataset", f"env.path={f}", "env.prompt_key=question", *BYTES])
    assert f"{f} line 3 has no field 'question' (env.prompt_key)" in msg
    msg = _plan_error(["env=dataset", f"env.path={f}", "env.prompt_template='Q: {q} / {question}'", *BYTES])
    assert "line 1 has no field 'q' (env.prompt_template)" in msg
    f2 = write_jsonl(tmp_path / "noanswer.jsonl", [{"question": "1"}])
    assert "no field 'answer' (env.answer_key)" in _plan_error(["env=dataset", f"env.path={f2}",
                                                              "env.prompt_key=question", *BYTES])


def _plan_error(overrides: list[str]) -> str:
    with pytest.raises(PlanError) as e:
        build_plan(compose(overrides))
    return str(e.value)


def test_plan_refusals_name_the_key(tmp_path, reward_module):
    f = write_jsonl(tmp_path / "train.jsonl", rows(10))
    base = ["env=dataset", f"env.path={f}", "env.prompt_key=question"]
    assert build_plan(compose([*base, *BYTES, "env.reward_fn=byot_rewards:score"])).roles
    assert "model.vocab_size is 16. Fix: model.vocab_size=264" in _plan_error(base)
    assert "cannot import module 'nope_module'" in _plan_error([*base, *BYTES, "env.reward_fn=nope_module:score"])
    assert "has no attribute 'missing'" in _plan_error([*base, *BYTES, "env.reward_fn=byot_rewards:missing"])
    assert "must be a function" in _plan_error([*base, *BYTES, "env.reward_fn=byot_rewards:NOT_CALLABLE"])
    assert "needs an eval split" in _plan_error([*base, *BYTES, "orchestrator.eval_every_steps=2"])
    assert "env.num_epochs(1) x 10 training records < 16 prompts" in _plan_error(
        [*base, *BYTES, "env.num_epochs=1", "trainer.num_steps=4", "orchestrator.num_prompts_per_step=4"])
    assert "not both" in _plan_error([*base, *BYTES, f"env.eval_path={f}", "env.eval_fraction=0.1"])
    long = write_jsonl(tmp_path / "long.jsonl", [{"question": "x" * 200, "answer": "1"}])
    assert f"the longest, {long} line 1, is 200 bytes" in _plan_error(["env=dataset", f"env.path={long}",
                                                                     "env.prompt_key=question", *BYTES])
    assert "set env.answer_key" in _plan_error([*base, *BYTES, "env.answer_key=''", "env.reward_fn=math_equal"])
    assert "has no field 'tests' (env.reward_fn=code_tests)" in _plan_error([*base, *BYTES, "env.reward_fn=code_tests"])
    # evaluation needs an env with an eval split
    assert build_plan(compose(["orchestrator.eval_every_steps=1"])).roles  # reverse_digits has a generated eval split


def test_verifiers_by_name_is_refused_by_the_plan():
    """``env=verifiers`` is refused with what is missing (test_envs_code_repair.py); naming it over
    another env's section is refused too, before anything starts (never a run-time NotImplementedError)."""
    assert "(env.name=verifiers, schema VerifiersConfig)" in _plan_error(["env.name=verifiers"])
    assert "env=verifiers is not implemented" in _plan_error(["env=verifiers"])


def test_byte_level_prompt_template_and_answer_in_sample(tmp_path, reward_module):
    f = write_jsonl(tmp_path / "train.jsonl", rows(4))
    cfg = DatasetConfig(path=str(f), prompt_template="Q: {question}", system_prompt="Be brief.", shuffle=False,
                        reward_fn="byot_rewards:score", answer_key="answer")
    env = DatasetEnv(cfg, seed=0)
    task = env.sample_task()
    assert task.prompt == "Q: 0+1" and task.sample == {"question": "0+1", "answer": "1"} and task.task_id == "0:0:0"
    tok = ByteTokenizer()
    assert env.prompt_ids(task) == [BOS, USER, *tok.encode("Be brief."), EOT, USER, *tok.encode("Q: 0+1"), EOT,
                                    ASSISTANT]
    assert env.stop_token_ids == (EOT,)

    async def answer(text: str) -> float:
        session = env.session(task, "e0")
        res = await session.step([*tok.encode(text), EOT])
        return res.reward, session.metrics

    assert asyncio.run(answer("1")) == (1.0, {"reward_failures": 0, "reward_calls": 1, "reward_timeouts": 0})
    assert asyncio.run(answer(" 2 "))[0] == 0.0


def test_eval_split_is_held_out_and_seeded(tmp_path):
    f = write_jsonl(tmp_path / "train.jsonl", rows(20))
    env = DatasetEnv(DatasetConfig(path=str(f), prompt_key="question", eval_fraction=0.25), seed=0)
    train = {r.fields["question"] for r in env.train}
    evals = [t.prompt for t in env.eval_tasks(100)]
    assert len(evals) == 5 and len(train) == 15 and not train & set(evals)
    again = DatasetEnv(DatasetConfig(path=str(f), prompt_key="question", eval_fraction=0.25), seed=0)
    assert [t.prompt for t in again.eval_tasks(3)] == evals[:3]
    other = write_jsonl(tmp_path / "eval.jsonl", rows(2, start=50))
    env2 = DatasetEnv(DatasetConfig(path=str(f), prompt_key="question", eval_path=str(other)), seed=0)
    assert len(env2.train) == 20 and [t.task_id for t in env2.eval_tasks(5)] == ["eval:0", "eval:1"]


def test_epochs_are_seeded_permutations_and_counted():
    order = data.DataOrder(5, seed=3, num_epochs=2)
    seen = [order.next() for _ in range(10)]
    assert sorted(r for e, _, r in seen if e == 0) == sorted(r for e, _, r in seen if e == 1) == list(range(5))
    assert [r for _, _, r in seen[:5]] != [r for _, _, r in seen[5:]]  # a new shuffle per epoch
    assert order.state() == {"epoch": 2, "index": 0, "drawn": 10} and order.draws_over == 0
    order.next()
    assert order.draws_over == 1
    assert [p for p in [data.DataOrder(5, seed=3).next() for _ in range(1)]] == [seen[0]]
    plain = data.DataOrder(3, seed=3, shuffle=False)
    assert [plain.next()[2] for _ in range(4)] == [0, 1, 2, 0]


def test_a_replayed_stream_resumes_without_skipping_or_repeating(tmp_path):
    """What a restarted orchestrator does (loop.py resume_from_ledger): replay as many draws as the
    ledger counts on a fresh env; the next tasks are exactly the ones the first env would have drawn."""
    f = write_jsonl(tmp_path / "train.jsonl", rows(7))
    cfg = DatasetConfig(path=str(f), prompt_key="question", num_epochs=0)
    first = make_env(cfg, seed=1)
    drawn = [first.sample_task() for _ in range(10)]  # crosses an epoch boundary
    expected = [first.sample_task().task_id for _ in range(9)]
    restarted = make_env(cfg, seed=1)
    replayed = [restarted.sample_task() for _ in range(10)]
    assert [t.task_id for t in replayed] == [t.task_id for t in drawn]
    assert restarted.state() == {"epoch": 1, "index": 3, "drawn": 10, "draws_over_num_epochs": 0,
                                 "prompts_skipped_too_long": 0}
    after = [restarted.sample_task().task_id for _ in range(9)]
    assert after == expected
    rows_trained = [t.split(":")[2] for t in [x.task_id for x in drawn] + after]
    assert sorted(rows_trained[:7]) == sorted(rows_trained[7:14]) == [str(i) for i in range(7)]  # every row once per epoch


def test_the_orchestrator_resumes_the_data_position_from_its_ledger(tmp_path, caplog):
    """Orchestrator.resume_from_ledger (loop.py), the real method, on a ledger left by a first run that
    launched 6 groups and batched 4: the 2 pending groups re-run with the same records, and new groups
    continue at draw 7; a changed dataset is reported (the task ids are data positions)."""
    import logging
    from collections import deque

    from workers.common.protocol import RunPaths
    from workers.orchestrator.buffer import RolloutBuffer
    from workers.orchestrator.ledger import Ledger
    from workers.orchestrator.loop import Orchestrator

    f = write_jsonl(tmp_path / "train.jsonl", rows(5))
    cfg = DatasetConfig(path=str(f), prompt_key="question")
    first = make_env(cfg, seed=2)
    paths = RunPaths(tmp_path / "run").ensure()
    led = Ledger(paths.root / "orchestrator_ledger.jsonl")
    launched = [first.sample_task() for _ in range(6)]
    for gid, task in enumerate(launched):
        led.launch(gid, task.task_id, worker=0)
    led.batch(1, [0, 1, 2, 3])
    led.close()
    upcoming = [first.sample_task().task_id for _ in range(3)]

    def restarted(env) -> Orchestrator:
        orch = object.__new__(Orchestrator)  # only what resume_from_ledger reads
        orch.env, orch.paths, orch.log = env, paths, logging.getLogger("test.resume")
        orch.retry, orch.ledger = deque(), Ledger(paths.root / "orchestrator_ledger.jsonl")
        orch.buffer = RolloutBuffer(max_off_policy_steps=1, groups_per_step=4)
        orch.resume_from_ledger()
        return orch

    orch = restarted(make_env(cfg, seed=2))
    assert orch.next_step == 2 and orch.next_group_id == 6
    assert [(gid, t.task_id) for gid, t, _ in orch.retry] == [(4, launched[4].task_id), (5, launched[5].task_id)]
    assert [orch.env.sample_task().task_id for _ in range(3)] == upcoming
    write_jsonl(f, rows(6))  # the data changed under the run: its order (and so the positions) differ
    with caplog.at_level(logging.WARNING, logger="test.resume"):
        restarted(make_env(cfg, seed=2))
    assert "replayed tasks differ from the ledger's" in caplog.text


def word_tokenizer():
    """A tiny transformers tokenizer with a chat template, standing in for a pretrained model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, "<|user|>": 2, "<|assistant|>": 3, "<|system|>": 4}
    for w in "what is 2 + 3 ? 5 be brief .".split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                 additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"])
    hf.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return hf, vocab


def test_a_model_tokenizer_and_chat_template_are_used_when_given(tmp_path):
    pytest.importorskip("transformers")
    hf, vocab = word_tokenizer()
    f = write_jsonl(tmp_path / "t.jsonl", [{"q": "what is 2 + 3 ?", "answer": "5"}, {"q": "2 " * 40, "answer": "2"}])

    class Model:  # what DatasetEnv reads of a pretrained model's config
        max_position_embeddings, pretrained = 24, "fake"

    env = DatasetEnv(DatasetConfig(path=str(f), prompt_key="q", system_prompt="be brief .", shuffle=False,
                                   max_new_tokens=4), seed=0, model=Model(), tokenizer=hf)
    task = env.sample_task()
    assert env.prompt_ids(task) == [4, vocab["be"], vocab["brief"], vocab["."], 0, 2, *[vocab[w] for w in
                                    "what is 2 + 3 ?".split()], 0, 3]
    assert env.stop_token_ids == (0,) and env.text([vocab["5"], 0]) == "5"
    res = asyncio.run(env.session(task, "e").step([vocab["5"], 0]))
    assert res.reward == 1.0
    again = env.sample_task()  # the 40-word prompt does not fit 24 - 4 tokens: skipped, counted, logged
    assert again.prompt == task.prompt and env.state()["prompts_skipped_too_long"] == 1
