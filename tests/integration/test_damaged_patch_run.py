"""Issue 47 items 1 and 2: one damaged patch step never stops a run, and any step of it can be evaluated.

One real local run with sparse patches (``delta_full_every=10``, ``max_off_policy_steps=2``) whose trainer
damages five patch steps before they appear (tests/plugins/damaged_weights_plugin.py: a wrong base, a
flipped byte, a truncated and a deleted patch file, a garbage index.json): each is refused by the workers,
the orchestrator asks for a full step (workers/weights/filesystem/reanchor.py), the trainer writes one at
once, and the run goes on. Nothing is lost: every step once in metrics.jsonl, no trainer restart, the
trainer never waited long for a batch, every update after verified. Then ``slurmrl-eval`` on the last patch
step (anchor + patches), on damaged copies (fails at once, naming why) and under SIGTERM (no scratch
directory with its admin token left behind, no server left running)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.configs import REPO
from tests.helpers.local_runs import _alive
from tests.integration.conftest import SMALL, assert_no_children_left, metrics

pytestmark = pytest.mark.slow

NUM_STEPS = 16
KINDS = ["base", "flip", "truncate", "delete", "index"]  # base first: it needs a patch two versions after an anchor
ENV = dict(os.environ, SLURMRL_PLUGINS="tests.plugins.damaged_weights_plugin")


@pytest.fixture(scope="module")
def damaged_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("damaged")
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp / 'runs'}", *SMALL,
           "weights=damaged_patches", f"weights.damage='{','.join(KINDS)}'", "weights.damage_gap=2",
           "weights.verify=true", f"trainer.num_steps={NUM_STEPS}", "trainer.dtype=bfloat16",
           "inference.dtype=bfloat16", "trainer.lr=1e-4", "trainer.batch_timeout_s=90",
           "orchestrator.max_off_policy_steps=2", f"launcher.run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return run_dir


def test_each_kind_of_damaged_patch_is_replaced_by_an_anchor_and_the_run_goes_on(damaged_run):
    run_dir = damaged_run
    damaged = [json.loads(x) for x in (run_dir / "weights_damaged.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in damaged] == KINDS, damaged
    # batch N needs weights of version >= N - 1 - max_off_policy_steps: the run had to get past every damage
    assert damaged[-1]["version"] <= NUM_STEPS - 4, damaged
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, NUM_STEPS + 1))  # every step once
    assert max(r["idle_s"] for r in recs) < 30, [round(r["idle_s"], 1) for r in recs]  # never near the timeout
    last = recs[-1]
    assert last["weight_reanchors_total"] >= len(damaged), last  # one anchor out of turn per damaged step at least
    assert last["weight_updates_refused"] >= len(damaged) and last["weight_updates_mismatched"] == 0, last
    assert last["weight_updates_verified"] >= 3, last  # the anchors out of turn and the patches after them
    assert not (run_dir / "checkpoints" / "resumes.jsonl").exists()  # the trainer never restarted
    orch = (run_dir / "logs" / "orchestrator_0.log").read_text()
    assert "Traceback" not in (run_dir / "logs" / "trainer_0.log").read_text()
    assert orch.count("asked the trainer for a full step") >= len(damaged)
    for d in damaged:  # each damaged version was refused (itself, or a patch on top of it), then written again
        assert any(f"weights v{v} refused for its content" in orch for v in range(d["version"], d["version"] + 3)), d
    assert_no_children_left(run_dir)


def _newest_patch_step(run_dir):
    for d in sorted((run_dir / "weights").glob("step_*"), reverse=True):
        if json.loads((d / "index.json").read_text()).get("format") == "slurmrl-delta/1":
            return d
    raise AssertionError("no patch step kept")


def _eval(step_dir, tmp, *extra, timeout=180):
    return subprocess.run([sys.executable, "-m", "workers.orchestrator.evaluate_step", str(step_dir),
                           "--num-samples", "2", *extra], cwd=REPO, env=dict(ENV, TMPDIR=str(tmp)),
                          capture_output=True, text=True, timeout=timeout)


def test_slurmrl_eval_serves_a_patch_step_through_its_chain_and_fails_at_once_on_damage(damaged_run, tmp_path):
    step_dir = _newest_patch_step(damaged_run)
    step = int(step_dir.name[5:])
    (tmp_path / "scratch").mkdir()
    ev = _eval(step_dir, tmp_path / "scratch", "--out", str(tmp_path / "eval.json"))
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["step"] == step and result["eval/policy_version"] == step, result
    copy = tmp_path / "copy"
    shutil.copytree(damaged_run / "weights", copy / "weights", symlinks=True)
    shutil.copytree(damaged_run / "config", copy / "config")
    patch = next((copy / "weights" / step_dir.name).glob("patch-*.safetensors"))
    blob = bytearray(patch.read_bytes())
    blob[-1] ^= 0xFF
    patch.write_bytes(bytes(blob))
    t0 = time.monotonic()
    ev = _eval(copy / "weights" / step_dir.name, tmp_path / "scratch")
    assert ev.returncode == 2 and f"refused step {step}" in ev.stderr and "checksum" in ev.stderr, ev.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and "Traceback" not in ev.stderr  # at once: not after startup_timeout_s
    anchor = json.loads((step_dir / "index.json").read_text())["anchor"]
    shutil.rmtree(copy / "weights" / f"step_{anchor:06d}")
    ev = _eval(copy / "weights" / step_dir.name, tmp_path / "scratch")
    assert ev.returncode == 2 and f"chain needs {copy / 'weights' / f'step_{anchor:06d}'}" in ev.stderr, ev.stderr
    assert not list((tmp_path / "scratch").glob("slurmrl-eval-*"))  # every scratch dir (and its admin token) removed


def test_a_sigtermed_slurmrl_eval_leaves_no_scratch_dir_and_no_server(damaged_run, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "workers.orchestrator.evaluate_step",
                             str(_newest_patch_step(damaged_run)), "--num-samples", "64"],
                            cwd=REPO, env=dict(ENV, TMPDIR=str(scratch)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline, children = time.monotonic() + 60, []
    while time.monotonic() < deadline and not children:
        time.sleep(0.2)
        children = _children(proc.pid)
    assert children and list(scratch.glob("slurmrl-eval-*/admin_token")), "the eval never started its server"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by signal" in err, err[-2000:]
    assert not list(scratch.glob("slurmrl-eval-*"))
    assert not [pid for pid in children if _alive(pid)]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as fh:
                if d.isdigit() and int(fh.read().split(")")[-1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError):
            continue
    return out

