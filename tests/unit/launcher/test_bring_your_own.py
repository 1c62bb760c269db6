"""Bring your own model, task and reward together (model.path + env=dataset + a reward module): the
plan checks them as one, reports every problem in one message with the fix that works for a
checkpoint (its config.json cannot be overridden), and a checkpoint with tokenizer files is read with
its own tokenizer instead of bytes."""
from __future__ import annotations

import json
import sys

import pytest

from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.models.hf_dirs import llama_dir
from workers.orchestrator.envs import make_env


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    (d / "train.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                           for i in range(8)))
    (d / "byo_rewards.py").write_text("def score(prompt, completion, sample):\n"
                                      "    return float(completion.strip() == sample['answer'])\n")
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("byo_rewards", None)


def task(data, *extra):
    return ["env=dataset", f"env.path={data / 'train.jsonl'}", "env.prompt_key=question",
            "env.reward_fn=byo_rewards:score", "env.max_new_tokens=8", *extra]


def plan_message(ckpt, data, *extra) -> str:
    overrides = [f"model.path={ckpt}", *task(data, *extra)]
    with pytest.raises(PlanError) as e:
        build_plan(resolve_model_path(compose(overrides), explicit_model_keys(overrides)))
    return str(e.value)


def test_small_vocabulary_checkpoint_gets_the_fix_that_works_not_circular_advice(tmp_path, data):
    ckpt = llama_dir(tmp_path / "ckpt64", vocab_size=64)
    msg = plan_message(ckpt, data)
    assert "has no tokenizer files" in msg and "config.json says vocab_size 64" in msg
    assert "add tokenizer files" in msg and "rebuild the checkpoint with vocab_size >= 264" in msg
    assert "set model.vocab_size=264" not in msg  # that override is refused for a checkpoint
    # following the old advice: the contradiction AND the env's problem, in one message, with the keys that apply
    msg = plan_message(ckpt, data, "model.vocab_size=264", "model.max_position_embeddings=256")
    assert "2 model.* overrides do not apply" in msg
    assert "model.vocab_size=264 contradicts" in msg and "model.max_position_embeddings=256 contradicts" in msg
    assert "drop those overrides" in msg and "model.init_seed" in msg.split("Overrides that apply")[1]
    assert "add tokenizer files" in msg


def test_every_problem_in_one_message(tmp_path, data):
    ckpt = llama_dir(tmp_path / "ckpt64", vocab_size=64, max_position_embeddings=32)
    msg = plan_message(ckpt, data, "env.max_new_tokens=40", "env.reward_fn=nope_module:score")
    assert "3 problems" in msg, msg
    assert "vocab_size 64" in msg and "env.max_new_tokens(40) must be < model.max_position_embeddings(32)" in msg
    assert "comes from" in msg and "cannot be overridden" in msg and "cannot import module 'nope_module'" in msg


def test_byte_level_checkpoint_plans_and_a_tokenizer_checkpoint_uses_its_tokenizer(tmp_path, data):
    byte_ckpt = llama_dir(tmp_path / "bytes", vocab_size=264)
    overrides = [f"model.path={byte_ckpt}", *task(data)]
    assert build_plan(resolve_model_path(compose(overrides), explicit_model_keys(overrides))).roles
    tok_ckpt = llama_dir(tmp_path / "tok", tokenizer_vocab=100)
    overrides = [f"model.path={tok_ckpt}", *task(data)]
    cfg = resolve_model_path(compose(overrides), explicit_model_keys(overrides))
    assert build_plan(cfg).roles
    env = make_env(cfg.env, seed=0, model=cfg.model)
    assert env.template is None and env.tokenizer is not None  # the checkpoint's tokenizer, not bytes
    ids = env.prompt_ids(env.sample_task())
    assert ids and max(ids) < 100


def doc_commands() -> list[str]:
    """The bash block of docs/guide/bring_your_own.md's "The command" section, one command per entry."""
    from tests.conftest import REPO

    text = (REPO / "docs" / "guide" / "bring_your_own.md").read_text()
    block = text.split("## The command", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [c.split("  #")[0].strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_documented_command_works_as_written(tmp_path):
    """The guide's two lines, run by bash from the repository root (the second as a dry run)."""
    import os
    import subprocess

    from tests.conftest import REPO

    make, run = doc_commands()
    assert make.startswith("python docs/examples/byot/make_checkpoint.py /tmp/my-llama")
    assert run.startswith("PYTHONPATH=$PWD/docs/examples/byot slurmrl model.path=/tmp/my-llama env=dataset")
    ckpt = tmp_path / "my-llama"
    make, run = (c.replace("/tmp/my-llama", str(ckpt)) for c in (make, run))
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", make.replace("python ", f"{sys.executable} ", 1)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    run = run.replace(" slurmrl ", f" {sys.executable} -m launcher ", 1)
    out = subprocess.run(["bash", "-c", f"{run} launcher.dry_run=true cluster.runs_root={tmp_path / 'runs'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run: resolved config in" in out.stdout
