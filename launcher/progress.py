"""One progress line per trainer step, read from run_dir/metrics.jsonl as it grows.

    step  12/50 | reward 0.340 (correct 0.300, format 0.040) | fail 12% (3 timeouts) | stale max 1 |
      dropped 0 | mismatch 3.1e-14 | 6632 tok/s train, 482 tok/s infer | idle 58% | 0.15 s |
      1m05s elapsed, ETA 4m01s
    step   5/50 eval | reward 0.500 | pass@1 0.500 | 16 answers (weights of step 5, reported at step 8)

``fail`` (the share of reward calls that raised, timed out or returned a non-number) appears only
when some failed; ``skipped N`` counts dataset rows whose prompt did not fit the context;
``mismatch`` is the KL between the trainer's and the inference engine's token logprobs (the
numerical train/inference mismatch, metrics.jsonl ``mismatch_kl``), NOT a KL to a reference model;
``teacher kl`` (on-policy distillation only) is the student's reverse KL to its teacher over the
sampled tokens (``teacher_reverse_kl``), the quantity distillation drives down.
An evaluation gets its own line, labelled with the step whose weights it evaluated.

A resumed run (``launcher.resume``) does not print again the steps already in metrics.jsonl: it
says after which step it goes on, and its elapsed time and ETA count from this launch.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from workers.common.logs import step_label
from workers.common.protocol import RunPaths


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h04m``."""
    s = int(round(max(seconds, 0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def reward_parts(rec: dict) -> str:
    parts = sorted((k.removeprefix("reward/"), v) for k, v in rec.items()
                   if k.startswith("reward/") and isinstance(v, (int, float)))
    return f" ({', '.join(f'{k} {v:.3f}' for k, v in parts)})" if parts else ""


def failures(rec: dict) -> str:
    """`` | fail 12% (3 timeouts)`` when reward calls failed; `` | skipped 2`` for rows that did not fit."""
    out = ""
    if rec.get("reward_failures"):
        frac = rec.get("reward_failure_frac")
        share = f"{frac:.0%}" if isinstance(frac, (int, float)) else str(rec["reward_failures"])
        timeouts = rec.get("reward_timeouts") or 0
        out += f" | fail {share}" + (f" ({timeouts} timeouts)" if timeouts else "")
    if rec.get("data/prompts_skipped_too_long"):
        out += f" | skipped {rec['data/prompts_skipped_too_long']}"
    return out


def format_step(rec: dict, num_steps: int, *, elapsed_s: Optional[float] = None,
                eta_s: Optional[float] = None) -> str:
    def g(key, fmt, default="-"):
        v = rec.get(key)
        return default if v is None else format(v, fmt)

    clock = "" if elapsed_s is None else f" | {duration(elapsed_s)} elapsed" + \
        ("" if eta_s is None else f", ETA {duration(eta_s)}")
    return (f"{step_label(rec['step'], num_steps)} | reward {g('reward_mean', '.3f')}{reward_parts(rec)}"
            f"{failures(rec)} | stale max {g('max_staleness', 'd')} | dropped {g('samples_dropped_stale', 'd')} | "
            f"mismatch {g('mismatch_kl', '.1e')}"
            f"{'' if rec.get('teacher_reverse_kl') is None else ' | teacher kl ' + g('teacher_reverse_kl', '.3f')} | "
            f"{g('tokens_per_s', '.0f')} tok/s train, "
            f"{g('inference_tokens_per_s', '.0f')} tok/s infer | idle {g('trainer_idle_frac', '.0%')} | "
            f"{g('step_time_s', '.2f')} s{clock}")


def eval_step(rec: dict) -> Optional[int]:
    """The step whose weights an eval in ``rec`` evaluated (weights version v = after step v)."""
    if "eval/reward" not in rec:
        return None
    v = rec.get("eval/weights_step", rec.get("eval/policy_version"))
    return int(v) if isinstance(v, (int, float)) else int(rec["step"])


def format_eval(rec: dict, num_steps: int) -> Optional[str]:
    """The eval line of ``rec`` (None without one), labelled with the evaluated weights' step."""
    step = eval_step(rec)
    if step is None:
        return None
    passes = sorted(k for k in rec if k.startswith("eval/pass@"))
    extra = "".join(f" | {k.removeprefix('eval/')} {rec[k]:.3f}" for k in passes if isinstance(rec[k], (int, float)))
    n = rec.get("eval/num_samples")
    where = "initial weights" if step == 0 else f"weights of step {step}"
    parts = reward_parts({k.removeprefix("eval/"): v for k, v in rec.items() if k.startswith("eval/reward/")})
    return (f"{step_label(step, num_steps)} eval | reward {rec['eval/reward']:.3f}{parts}{extra}"
            f"{f' | {n} answers' if n else ''} ({where}, reported at step {rec['step']})")


class ProgressPrinter:
    def __init__(self, paths: RunPaths, num_steps: int, *, started: Optional[float] = None, resumed: bool = False):
        """``started``: wall time the run started (elapsed and ETA count from it); None: from the
        first record's time minus its step time (a followed Slurm job that waited in the queue).
        ``resumed``: the steps metrics.jsonl holds now were printed by an earlier launch: read them
        silently (the summary still counts them) and say after which step the run goes on."""
        self.paths, self.num_steps = paths, num_steps
        self.offset = 0
        self.records: list[dict] = []
        self.inode: Optional[int] = None  # metrics.jsonl is replaced (not appended) when a trainer resumes
        self.rewound = False
        self.started = started
        self.first_step: Optional[int] = None  # the first step this printer saw (a resumed run starts later)
        self.first_time = 0.0
        if resumed:
            self.poll(quiet=True)
            print(f"[slurmrl] resuming after step {self.last_step()} (earlier steps are in {self.paths.metrics}); "
                  f"elapsed and ETA count from this launch", flush=True)

    def last_step(self) -> int:
        """The newest trained step among the records read (0 without one)."""
        return max((x["step"] for x in self.steps()), default=0)

    def clock(self, rec: dict) -> tuple[Optional[float], Optional[float]]:
        """(seconds since the run started, estimated seconds left) at ``rec``."""
        now = rec.get("time") if isinstance(rec.get("time"), (int, float)) else time.time()
        if self.started is None:
            self.started = now - float(rec.get("step_time_s") or 0.0)
        if self.first_step is None:
            self.first_step, self.first_time = int(rec["step"]), now
        elapsed = max(now - self.started, 0.0)
        since_first = int(rec["step"]) - self.first_step  # steps after the first one this printer saw
        left = max(self.num_steps - int(rec["step"]), 0)
        if since_first > 0:  # the rate of the steps themselves, not of start-up (model load, servers)
            return elapsed, (now - self.first_time) / since_first * left
        step_s = rec.get("step_time_s")
        return elapsed, (float(step_s) * left if isinstance(step_s, (int, float)) else None)

    def poll(self, *, quiet: bool = False) -> None:
        try:
            with open(self.paths.metrics, "r") as fh:
                st = os.fstat(fh.fileno())
                inode = st.st_ino
                if self.inode is not None and (inode != self.inode or st.st_size < self.offset):  # rewound
                    self.offset, self.records = 0, []
                    self.rewound = True
                    self.first_step = None  # the pace is measured again from the redone steps
                self.inode = inode
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        complete = chunk[: chunk.rfind("\n") + 1]  # never parse a half-written line
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            if line.strip():
                rec = json.loads(line)
                self.records.append(rec)
                if quiet:
                    continue
                if rec.get("final_eval") and not self.rewound:  # the final weights' eval: its own line only
                    print(format_eval(rec, self.num_steps), flush=True)
                elif not self.rewound:  # records kept by a rewind were printed before
                    elapsed, eta = self.clock(rec)
                    print(format_step(rec, self.num_steps, elapsed_s=elapsed, eta_s=eta), flush=True)
                    evaluated = format_eval(rec, self.num_steps)
                    if evaluated:
                        print(evaluated, flush=True)
        if self.rewound:
            self.rewound = False
            print(f"[slurmrl] trainer resumed from a checkpoint: metrics continue after step "
                  f"{self.last_step()}", flush=True)

    def steps(self) -> list[dict]:
        """One record per step, the newest of each, in step order: a redone step counts once even
        if its first record escaped the trainer's rewind (a restart the printer did not see)."""
        by_step = {x["step"]: x for x in self.records if isinstance(x.get("step"), int) and not x.get("final_eval")}
        return [by_step[s] for s in sorted(by_step)]

    def summary(self) -> str:
        steps = self.steps()
        r = [x["reward_mean"] for x in steps if "reward_mean" in x]
        if len(r) < 2:
            return f"{len(steps)} steps recorded"
        k = min(5, len(r))
        evals = [x for x in self.records if "eval/reward" in x]
        last_eval = (f", eval {evals[-1]['eval/reward']:.3f} (weights of step {eval_step(evals[-1])})"
                     if evals else "")
        failed = sum(x.get("reward_failures") or 0 for x in steps)
        fails = f", {failed} reward failures" if failed else ""
        return (f"{len(steps)} steps: reward first{k} {sum(r[:k]) / k:.3f} -> last{k} {sum(r[-k:]) / k:.3f}"
                f"{last_eval}, max staleness {max(x.get('max_staleness', 0) for x in steps)}{fails}")
