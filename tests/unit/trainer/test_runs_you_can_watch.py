"""Runs you can watch: TensorBoard scalars grouped (reward/ loss/ timing/ mismatch/ weights/ eval/),
an eval's scalars at the step whose weights it evaluated, and ``slurmrl plot`` writing a PNG of
reward, eval and timing curves for several runs."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from workers.common.protocol import RunPaths
from workers.common.metrics import MetricsWriter
from workers.common.tb_tags import tb_tag


def test_tags_are_grouped_and_weights_has_its_slot():
    assert [tb_tag(k) for k in ("reward_mean", "reward/correct", "reward_failure_frac", "loss", "grad_norm",
                                "step_time_s", "tokens_per_s", "mismatch_kl", "ratio_max", "weight_sync_s",
                                "weights/changed_frac", "weights/bytes_sent_over_dense", "eval/pass@1",
                                "max_staleness", "data/epoch", "host_rss_gib")] == [
        "reward/mean", "reward/correct", "reward/failure_frac", "loss/loss", "loss/grad_norm", "timing/step_time_s",
        "timing/tokens_per_s", "mismatch/mismatch_kl", "mismatch/ratio_max", "weights/weight_sync_s",
        "weights/changed_frac", "weights/bytes_sent_over_dense", "eval/pass@1", "async/max_staleness", "data/epoch",
        "system/host_rss_gib"]


def test_tensorboard_events_are_grouped_and_evals_sit_at_their_weights_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = RunPaths(tmp_path).ensure()
    w = MetricsWriter(paths)
    w.write({"step": 1, "time": 1.0, "reward_mean": 0.1, "loss": 0.5, "step_time_s": 2.0, "mismatch_kl": 1e-3})
    w.write({"step": 4, "time": 2.0, "reward_mean": 0.4, "loss": 0.3, "eval/reward": 0.75, "eval/weights_step": 2,
             "weights/changed_frac": 0.5})
    w.close()
    acc = EventAccumulator(str(paths.tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "loss/loss", "timing/step_time_s", "mismatch/mismatch_kl", "eval/reward",
            "weights/changed_frac"} <= tags and not any(t.startswith("trainer/") for t in tags)
    assert [(e.step, e.value) for e in acc.Scalars("eval/reward")] == [(2, 0.75)]
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 4]


def test_plot_writes_a_png_for_several_runs(tmp_path):
    runs = []
    for name, slope in (("a", 0.1), ("b", 0.2)):
        root = tmp_path / name
        root.mkdir()
        recs = [{"step": s, "reward_mean": slope * s, "step_time_s": 1.0} for s in range(1, 7)]
        recs[3].update({"eval/reward": 0.5, "eval/weights_step": 2})
        (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        runs.append(str(root))
    out = subprocess.run([sys.executable, "-m", "launcher", "plot", *runs, "--out", str(tmp_path / "p.png")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    default = subprocess.run([sys.executable, "-m", "launcher", "plot", runs[0]], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert default.returncode == 0 and (tmp_path / "a" / "plot.png").exists()
    bad = subprocess.run([sys.executable, "-m", "launcher", "plot", str(tmp_path / "none")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr


def test_curves_put_evals_at_the_weights_step(tmp_path):
    from launcher.plot import curves

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "reward_mean": 1.0, "eval/reward": 0.5,
                                                        "eval/weights_step": 3}) + "\n")
    c = curves(tmp_path)
    assert c["eval"] == ([3], [0.5]) and c["reward"] == ([5], [1.0]) and c["reward_avg"] == ([5], [1.0])
