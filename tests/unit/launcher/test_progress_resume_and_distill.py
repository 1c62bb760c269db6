"""The progress line of a resumed run and of distillation (issue 47 item 16): a resume does not print
the earlier steps again with "0s elapsed", says after which step it goes on (the newest trained step,
not the number of lines: a final eval row is a line), and its ETA counts from this launch's pace;
``teacher_reverse_kl`` is on the line and gets a ``plot`` panel. Real metrics.jsonl files."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

from launcher.progress import ProgressPrinter, format_step
from tests.conftest import REPO
from workers.common.protocol import RunPaths


def write(root, recs, *, replace=False):
    path = root / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in recs)
    if replace:  # the trainer's rewind writes a new file and renames it over the old one (a new inode)
        (root / "tmp.jsonl").write_text(text)
        os.replace(root / "tmp.jsonl", path)
    else:
        with open(path, "a") as fh:
            fh.write(text)


def test_a_resumed_run_goes_on_after_its_last_step_without_replaying(tmp_path, capsys):
    old = time.time() - 3600  # the first launch, an hour ago
    steps = [{"step": s, "reward_mean": 0.1, "step_time_s": 2.0, "time": old + s} for s in (1, 2, 3)]
    write(tmp_path, [*steps, {"step": 3, "final_eval": True, "eval/reward": 0.5, "eval/weights_step": 3}])
    printer = ProgressPrinter(RunPaths(tmp_path), 10, started=time.time(), resumed=True)
    printer.poll()
    out = capsys.readouterr().out
    assert "resuming after step 3" in out and "step   1/10" not in out and "eval" not in out, out
    write(tmp_path, [{"step": 4, "reward_mean": 0.2, "step_time_s": 2.0, "time": time.time()}])
    printer.poll()
    line = capsys.readouterr().out.strip()
    assert line.startswith("step   4/10 |") and line.endswith("0s elapsed, ETA 12s"), line  # 6 steps x 2 s
    write(tmp_path, [{"step": 5, "reward_mean": 0.2, "step_time_s": 2.0, "time": time.time() + 4}])
    printer.poll()
    assert capsys.readouterr().out.strip().endswith("ETA 20s")  # 4 s for one step, 5 left: this launch's pace
    # the trainer restarted from its step-3 checkpoint: the file is rewritten with steps 1-3 and the final eval row
    write(tmp_path, [*steps, {"step": 3, "final_eval": True, "eval/reward": 0.5}], replace=True)
    printer.poll()
    assert "metrics continue after step 3" in capsys.readouterr().out  # not 4 (the number of lines)
    assert printer.summary().startswith("3 steps:")


def test_distillation_reports_the_teachers_reverse_kl_on_the_line_and_in_plot(tmp_path):
    rec = {"step": 2, "reward_mean": 0.1, "teacher_reverse_kl": 0.7851}
    assert "| mismatch - | teacher kl 0.785 |" in format_step(rec, 4)
    assert "teacher kl" not in format_step({"step": 2, "reward_mean": 0.1}, 4)
    widths = {}
    for name, extra in (("grpo", {}), ("distill", {"teacher_reverse_kl": 0.5})):
        root = tmp_path / name
        root.mkdir()
        write(root, [{"step": s, "reward_mean": 0.1 * s, "step_time_s": 1.0, **extra} for s in range(1, 5)])
        out = subprocess.run([sys.executable, "-m", "launcher", "plot", str(root)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        png = (root / "plot.png").read_bytes()
        widths[name] = struct.unpack(">I", png[16:20])[0]  # IHDR width
    assert widths == {"grpo": 1500, "distill": 2000}  # a fourth panel for the teacher's KL
