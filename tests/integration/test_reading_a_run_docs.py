"""What docs/guide/reading_a_run.md and the README show a user is what a real run prints and writes
(issue 47 item 13): the progress line's fields, the quick-look one-liner (run as documented on a
run's metrics.jsonl, final eval row included) and the TensorBoard sections.

One real local run (the tiny model, the README's bring-your-own example data and reward, an eval
every step and the final weights' eval) feeds every test of this module."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.conftest import SMALL, metrics

pytestmark = pytest.mark.slow
DOC = REPO / "docs" / "guide" / "reading_a_run.md"
BYOT = REPO / "docs" / "examples" / "byot"
TINY = ["model.vocab_size=264", "model.max_position_embeddings=64", "model.hidden_size=32", "model.num_layers=1",
        "model.expert_intermediate_size=32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reading")
    args = [*SMALL, *TINY, "env=dataset", f"env.path={BYOT / 'train.jsonl'}", "env.prompt_key=question",
            "env.reward_fn=my_rewards:REWARDS", f"env.eval_path={BYOT / 'eval.jsonl'}", "env.max_new_tokens=4",
            "orchestrator.eval_every_steps=1", "orchestrator.eval_num_samples=4", "trainer.num_steps=2",
            f"cluster.runs_root={tmp / 'runs'}"]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{BYOT}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_dir = (tmp / "runs" / "latest").resolve()
    return proc.stdout, run_dir


def labels(line: str) -> list[str]:
    """The field names of a progress line: each ``|`` part without its numbers (and named rewards)."""
    return [re.sub(r"\s+", " ", re.sub(r"\(.*\)|\d+h\d+m|\d+m\d+s|\d+s\b|[-+]?\d[\d.e+-]*%?", "", part)).strip()
            for part in line.split("|")[1:]]


def documented_line(text: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith("step ") and "|" in ln)


def test_the_documented_progress_line_is_the_one_a_run_prints(run):
    stdout, _ = run
    printed = next(ln for ln in stdout.splitlines() if re.match(r"step +2/2 \|", ln))
    readme = documented_line((REPO / "README.md").read_text())
    guide = documented_line(DOC.read_text())
    assert readme == guide
    assert labels(guide) == labels(printed), (guide, printed)
    table = re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), re.M)  # every field has a row in the table
    assert all(any(lab.split()[0] in row for row in table) for lab in labels(printed) if lab), (labels(printed), table)


def test_the_documented_quick_look_runs_on_a_real_run_with_its_final_eval_row(run):
    _, run_dir = run
    recs = metrics(run_dir)
    assert any(r.get("final_eval") for r in recs), "the run wrote no final eval row"
    text = DOC.read_text()
    block = text.split("A quick look without TensorBoard:", 1)[1].split("```", 2)[1].strip()
    assert block.startswith("python -c ")
    command = block.replace("python -c ", "", 1).strip()[1:-1].replace("runs/latest", str(run_dir))
    out = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert len(rows) == len(recs) and rows[0].split()[0] == "1", rows
    assert rows[-1].split()[1] == "-"  # the final eval row: no training reward, its eval reward instead


def test_the_documented_tensorboard_sections_are_the_real_tags(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    documented = set(re.findall(r"^\| `(\w+)/` \|", DOC.read_text(), re.M))
    assert {"reward", "loss", "mismatch", "timing", "async", "eval"} <= documented
    assert {t.split("/", 1)[0] for t in tags} <= documented, sorted(tags)
    for tag in ("reward/mean", "loss/loss", "mismatch/mismatch_kl", "timing/step_time_s", "async/max_staleness",
                "eval/reward"):
        assert tag in tags and f"`{tag}`" in DOC.read_text(), tag
    assert "trainer/<key>" not in DOC.read_text()
