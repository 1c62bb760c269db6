"""``slurmrl plot RUN [RUN...] [--out FILE|DIR]``: reward, eval and timing curves of one or more runs,
read from each run's metrics.jsonl, as one PNG (three panels; one line per run, labelled with the
run directory's name). Default output: ``<first run>/plot.png``; ``--out DIR`` writes ``DIR/plot.png``.
It prints the path it wrote. Lines of metrics.jsonl that are not step records are skipped.

    slurmrl plot runs/latest
    slurmrl plot runs/lr-1e-4 runs/lr-3e-4 --out lr.png

Panels: train reward (``reward_mean`` per step, and its mean over a 5-step window), eval reward
(``eval/reward`` at the step whose weights were evaluated), seconds per step (``step_time_s``), and
for on-policy distillation a fourth: the student's reverse KL to its teacher (``teacher_reverse_kl``).
Needs matplotlib (``pip install matplotlib``; installed with the ``dev`` and ``plot`` extras).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from launcher.run_status import finite, records
from workers.common.protocol import RunPaths

WINDOW = 5


def curves(root: Path) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) for reward, reward_avg, eval, step_time, teacher_kl (distillation)."""
    recs = records(RunPaths(root))
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(name: str, step: int, value) -> None:
        v = finite(value)
        if v is not None:
            out.setdefault(name, ([], []))
            out[name][0].append(step)
            out[name][1].append(v)

    for r in recs:
        add("reward", r["step"], r.get("reward_mean"))
        add("step_time", r["step"], r.get("step_time_s"))
        add("teacher_kl", r["step"], r.get("teacher_reverse_kl"))
        if "eval/reward" in r:
            at = r.get("eval/weights_step", r.get("eval/policy_version", r["step"]))
            add("eval", at if isinstance(at, int) else r["step"], r["eval/reward"])
    if "reward" in out:
        steps, values = out["reward"]
        out["reward_avg"] = (steps, [sum(values[max(0, i - WINDOW + 1): i + 1]) / len(values[max(0, i - WINDOW + 1): i + 1])
                                     for i in range(len(values))])
    return out


def plot(runs: list[Path], out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("slurmrl plot: error: needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    all_curves = [curves(root) for root in runs]
    distill = any("teacher_kl" in c for c in all_curves)
    fig, axes = plt.subplots(1, 4 if distill else 3, figsize=(20 if distill else 15, 4))
    ax_r, ax_e, ax_t = axes[:3]
    panels = [(ax_r, f"train reward (faint: per step; line: {WINDOW}-step mean)", "reward"),
              (ax_e, "eval reward (at the evaluated weights' step)", "eval/reward"),
              (ax_t, "seconds per trainer step", "step_time_s")]
    if distill:
        panels.append((axes[3], "reverse KL to the teacher (distillation)", "teacher_reverse_kl"))
    for i, (root, c) in enumerate(zip(runs, all_curves)):
        color = f"C{i}"
        if "reward" in c:
            ax_r.plot(*c["reward"], color=color, alpha=0.3)
            ax_r.plot(*c["reward_avg"], color=color, label=root.name)
        if "eval" in c:
            ax_e.plot(*c["eval"], color=color, marker="o", label=root.name)
        if "step_time" in c:
            ax_t.plot(*c["step_time"], color=color, label=root.name)
        if "teacher_kl" in c:
            axes[3].plot(*c["teacher_kl"], color=color, label=root.name)
    for ax, title, ylabel in panels:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="slurmrl plot", description="reward, eval and timing curves of runs (PNG)")
    p.add_argument("runs", nargs="+", help="run directories (runs/latest, runs/NAME, ...)")
    p.add_argument("--out", help="PNG to write, or a directory to write plot.png into (default: <first run>/plot.png)")
    a = p.parse_args(argv)
    runs = [Path(r).expanduser().resolve() for r in a.runs]
    for r in runs:
        if not RunPaths(r).metrics.is_file():
            print(f"slurmrl plot: error: {r} has no metrics.jsonl (not a run directory, or no step finished yet)",
                  file=sys.stderr)
            return 2
    out = output_path(a.out, runs[0])
    try:
        out = plot(runs, out)
    except OSError as e:  # an unwritable --out: one line, not a traceback
        print(f"slurmrl plot: error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def output_path(given: Optional[str], first_run: Path) -> Path:
    """``--out``: a file, or a directory (existing, or written with a trailing /) to put plot.png into."""
    if not given:
        return first_run / "plot.png"
    out = Path(given).expanduser()
    return out / "plot.png" if out.is_dir() or given.endswith("/") else out
