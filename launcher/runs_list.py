"""``slurmrl status --all [RUNS_ROOT]``: every run under the runs root in one table.

One Slurm query for all submitted runs, not one scontrol per job every few seconds: submitit's
batched sacct watcher (:class:`HetjobWatcher`, one ``sacct -j A -j B ...`` for every registered
job, with the pending reason) and ``squeue`` only for the jobs sacct does not know (no
accounting, or a job submitted a moment ago): a sweep of 50 points costs one or two commands. Local and dry runs are read from their run
directory alone (trainer steps logged, the last step's mean reward, whether the trainer finished).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from submitit.slurm.slurm import SlurmInfoWatcher

from launcher.run_status import finite, local_state, records, trained
from launcher.submit import job_id_file, run
from workers.common.protocol import RunPaths


@dataclasses.dataclass(frozen=True)
class RunRow:
    name: str
    job_id: Optional[str]
    state: str
    steps: int
    last_reward: Optional[float]
    reason: str


def last_metrics(paths: RunPaths) -> tuple[int, Optional[float]]:
    """(trainer steps logged, reward_mean of the last one)."""
    recs = trained(records(paths))
    return len(recs), (finite(recs[-1].get("reward_mean")) if recs else None)


class HetjobWatcher(SlurmInfoWatcher):
    """submitit's batched sacct watcher, taught our hetjobs: sacct lists a hetjob's parts as
    ``L+K``, which submitit keys as they are; the job's state is its part 0's (the batch
    script's, whose exit status decides), under the leader id ``L`` we register. Asks sacct
    for the pending ``Reason`` too."""

    def _make_command(self) -> Optional[list[str]]:
        command = super()._make_command()
        if command is not None:
            command[command.index("-o") + 1] = "JobID,State,Reason,NodeList"
        return command

    def read_info(self, string) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        for job_id, stats in list(info.items()):
            leader, plus, part = job_id.partition("+")
            if plus and part == "0":
                info.setdefault(leader, stats)
        return info


def slurm_states(job_ids: list[str], *, watcher: Optional[HetjobWatcher] = None) -> dict[str, tuple[str, str]]:
    """job id -> (state, pending reason) for every id: one sacct through submitit's watcher,
    then one squeue for the ids sacct does not know (yet)."""
    if not job_ids:
        return {}
    watcher = watcher or HetjobWatcher(delay_s=0)
    for j in job_ids:
        watcher.register_job(j)
    watcher.update()  # one sacct for all (a failed sacct, e.g. no accounting, leaves every id unknown)
    out: dict[str, tuple[str, str]] = {}
    for j in job_ids:
        info = watcher.get_info(j, mode="cache")
        if info.get("State"):
            reason = info.get("Reason", "")
            state = info["State"].split()[0]
            out[j] = (state, "" if reason in ("None", "(null)") or state != "PENDING" else reason)
    missing = [j for j in job_ids if j not in out]
    if missing:
        res = run(["squeue", "-h", "-j", ",".join(missing), "-o", "%i|%T|%r"], check=False)
        for line in res.stdout.splitlines():
            jid, state, reason = (line.split("|") + ["", ""])[:3]
            leader = jid.split("+")[0]
            if leader in missing and (leader not in out or state == "PENDING"):
                out[leader] = (state, "" if reason in ("None", "(null)") else reason)
    return {j: out.get(j, ("ENDED", "unknown to sacct and squeue")) for j in job_ids}


def collect(runs_root: Path) -> list[RunRow]:
    """Every run directory (one holding config/run.yaml) under ``runs_root``, newest first."""
    dirs = sorted((p.parent.parent for p in Path(runs_root).glob("**/config/run.yaml")),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    ids = {}
    for d in dirs:
        try:
            if job_id_file(d).exists():
                ids[d] = job_id_file(d).read_text().strip()
        except (OSError, UnicodeDecodeError):
            pass  # its row says what is wrong
    states = slurm_states(sorted(set(ids.values())))
    rows = []
    for d in dirs:  # one damaged run must not hide the others: its row says what is wrong
        try:
            steps, reward = last_metrics(RunPaths(d))
            state, reason = states[ids[d]] if d in ids else (local_state(d, steps), "")
        except (OSError, ValueError) as e:
            steps, reward, state, reason = 0, None, "UNREADABLE", f"{type(e).__name__}: {e}"[:120]
        rows.append(RunRow(name=str(d.relative_to(runs_root)), job_id=ids.get(d), state=state, steps=steps,
                           last_reward=reward, reason=reason))
    return rows


def table(rows: list[RunRow]) -> str:
    head = ("RUN", "JOB", "STATE", "STEPS", "REWARD", "REASON")
    body = [(r.name, r.job_id or "-", r.state, str(r.steps), "-" if r.last_reward is None else f"{r.last_reward:.3f}",
             r.reason or "-") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body])


def list_command(runs_root: Optional[str]) -> int:
    root = Path(runs_root or "runs").expanduser().resolve()
    if not root.is_dir():
        print(f"slurmrl status --all: {root} is not a directory (the runs root: cluster.runs_root)")
        return 2
    rows = collect(root)
    print(table(rows) if rows else f"no runs under {root}")
    return 0
