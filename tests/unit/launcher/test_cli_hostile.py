"""Issue 47 items 8-11: the commands a user types never answer with a traceback.

8  ``status``, ``status --all`` and ``plot`` read metrics.jsonl lines that are not objects, bytes that are
   not UTF-8, records without ``step``, numbers too large for a float: such lines are skipped; a file
   given as RUN and an unwritable ``--out`` are one-line errors; one bad run never hides the others;
   ``slurmrl-eval --out`` is checked before the eval starts.
9  ``algorithm.name=dapo`` alone (a GRPO run labelled dapo) is refused; an override Hydra cannot parse is
   named; a patch whose values are not the trainer's is not blamed on the receiver alone.
10 ``slurmrl resume RUN`` works as listed; ``resume --help``, ``preflight --help``, ``status --help`` exit 0.
11 ``plot --out DIR`` writes DIR/plot.png and prints what it wrote.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.configs import REPO

HOSTILE = (b'[1, 2]\n"text"\n{"no_step": 1}\n\xff\xfe\xfd not utf-8\n{"step": "x"}\n{"step": 1, "reward_mean": 0.25, '
           b'"eval/reward": 0.5, "eval/weights_step": "q"}\n{"step": 2, "reward_mean": 1' + b"0" * 400 + b'}\n{"ste')


def _cli(args, cwd=REPO, timeout=120):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _main(args, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """``slurmrl ARGS`` in this process, for the commands that answer before Hydra composes (cheap)."""
    from launcher.__main__ import main

    monkeypatch.setattr(sys, "argv", ["slurmrl", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, e.value.code or 0, out.out, out.err)


def _run(root: Path, metrics: bytes, steps: int = 4) -> Path:
    (root / "config").mkdir(parents=True)
    (root / "config" / "run.yaml").write_text(f"trainer:\n  num_steps: {steps}\n")
    (root / "metrics.jsonl").write_bytes(metrics)
    return root


def test_status_and_plot_skip_hostile_metrics_lines_and_name_bad_targets(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    bad = _run(runs / "bad", HOSTILE)
    _run(runs / "good", b'{"step": 1, "reward_mean": 0.5}\n')
    _run(runs / "locked", b"")
    (runs / "locked" / "slurm").mkdir()
    (runs / "locked" / "slurm" / "job_id").mkdir()  # a directory where the job id file should be
    (tmp_path / "afile").write_text("not a run\n")
    res = _main(["status", str(bad)], capsys, monkeypatch)
    assert res.returncode == 0 and "step 2/4" in res.stdout and "last eval 0.500 (weights of step 1)" in res.stdout, \
        res.stdout + res.stderr
    assert f"slurmrl resume {bad}" in res.stdout  # the next command, as listed
    res = _main(["status", "--all", str(runs)], capsys, monkeypatch)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines()[1:]}
    assert set(rows) == {"bad", "good", "locked"} and "0.500" in rows["good"], res.stdout
    res = _main(["status", str(tmp_path / "afile")], capsys, monkeypatch)
    assert res.returncode == 1 and "is not a run directory" in res.stdout + res.stderr and "Traceback" not in res.stderr
    res = _main(["plot", str(bad), "--out", str(tmp_path / "plots") + "/"], capsys, monkeypatch)  # item 11: a directory
    assert res.returncode == 0 and res.stdout.strip() == f"wrote {tmp_path / 'plots' / 'plot.png'}", res.stderr
    assert (tmp_path / "plots" / "plot.png").stat().st_size > 1000
    res = _main(["plot", str(bad), "--out", str(tmp_path / "plots")], capsys, monkeypatch)  # an existing directory
    assert res.returncode == 0 and res.stdout.strip() == f"wrote {tmp_path / 'plots' / 'plot.png'}", res.stderr
    res = _main(["plot", str(bad), "--out", str(tmp_path / "afile" / "x.png")], capsys, monkeypatch)  # below a file: not writable
    assert res.returncode == 2 and res.stderr.startswith("slurmrl plot: error: --out") and "Traceback" not in res.stderr
    res = _main(["plot", str(tmp_path / "afile")], capsys, monkeypatch)
    assert res.returncode == 2 and "has no metrics.jsonl" in res.stderr


def test_slurmrl_eval_checks_out_before_it_starts(tmp_path, capsys):
    from workers.orchestrator.evaluate_step import main

    (tmp_path / "afile").write_text("x")
    for out, why in [(tmp_path, "is a directory"), (tmp_path / "nope" / "e.json", "does not exist"),
                     (tmp_path / "afile" / "e.json", "does not exist")]:
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "step_000001"), "--out", str(out)])
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_algorithm_label_and_unparsable_overrides_are_named(tmp_path, capsys, monkeypatch):
    res = _cli([f"cluster.runs_root={tmp_path}", "algorithm.name=dapo", "launcher.dry_run=true"])
    assert res.returncode == 2 and "choose the recipe with algorithm=dapo" in res.stderr, res.stderr
    res = _main([f"cluster.runs_root={tmp_path}", "trainer.lr=[", "launcher.dry_run=true"], capsys, monkeypatch)
    assert res.returncode == 2 and "cannot parse the override 'trainer.lr=['" in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_subcommands_work_as_listed_and_help_exits_0(tmp_path, capsys, monkeypatch):
    for args, text in [(["resume", "--help"], "usage: slurmrl resume RUN_DIR"), (["status", "--help"], "usage:"),
                       (["status", "--all", "--help"], "usage:"), (["--help"], "resume RUN_DIR")]:
        res = _main(args, capsys, monkeypatch)
        assert res.returncode == 0 and text in res.stdout and "Traceback" not in res.stderr, (args, res.stderr)
    res = _cli(["preflight", "--help"])  # its own process (exec)
    assert res.returncode == 0 and "slurmrl-preflight" in res.stdout, res.stderr
    res = _main(["resume"], capsys, monkeypatch)
    assert res.returncode == 2 and "usage: slurmrl resume" in res.stderr
    run = tmp_path / "runs" / "r"
    assert _cli([f"cluster.runs_root={tmp_path / 'runs'}", f"launcher.run_dir={run}", "launcher.dry_run=true"]).returncode == 0
    res = _cli(["resume", str(run), "trainer.num_steps=500", "launcher.dry_run=true"])
    assert res.returncode == 0 and f"would resume {run}" in res.stdout, res.stdout + res.stderr


def test_a_patch_value_that_is_not_the_trainers_is_not_blamed_on_the_receiver_alone(tmp_path):
    import torch

    from tests.unit.weights.test_weights_patches import Receiver, _master, _publisher, _train
    from workers.common.protocol import step_name
    from workers.weights.base import WeightLoadError
    from workers.weights.delta.apply import apply_chain
    from workers.weights.filesystem.patch_reader import read_parts
    from workers.weights.stream import DictStream

    master, pub = _master(), _publisher(tmp_path, publish_async=False)
    r = Receiver(master)
    for v in range(2):
        if v:
            _train(master, v)
        pub.publish(v, DictStream(master, dtype=torch.bfloat16))
        if v == 0:
            r.load(tmp_path / step_name(0))
    pub.close()
    step = tmp_path / step_name(1)
    index = json.loads((step / "index.json").read_text())
    parts = read_parts(step, index)
    name = next(iter(parts))
    parts[name][0].values.add_(1.0)  # altered after publishing, its checksums recomputed to match
    sums = {n: int(m["sum64"], 16) for n, m in index["tensors"].items()}
    with pytest.raises(WeightLoadError, match="the patch's values are not the trainer's"):
        apply_chain(r.params, [(parts, sums, str(step))], r.sums)
