"""Trainer checkpoints: survive preemption (Slurm requeue, SIGUSR1/SIGTERM) and crashes.

What is saved, per rank: the model's state dict (this rank's shards under TP/EP), the
optimizer state, the RNG states (torch, numpy, python) and the step to resume at. Where:
``run_dir/checkpoints/step_N/rank_R.pt`` + ``COMPLETE`` (the state after 1-based step N, so
N = steps already trained and a resumed trainer goes on with step N+1, batch ``rollouts/step_{N+1}``).

Atomic without a collective (a preempted rank cannot count on its peers): every rank
writes ``.step_N.tmp/rank_R.pt`` via its own temp file + rename; the rank that finds all
``world_size`` rank files present writes ``COMPLETE`` (last) and renames the directory to
``step_N``. A reader only accepts ``step_N/COMPLETE`` with all rank files; temp dirs and
anything unreadable are skipped with a log line, so a kill at any point leaves either the
new checkpoint or the previous one.

When: after every ``trainer.checkpoint_every_steps`` steps, after the step in progress when
SIGUSR1 arrives (Slurm's ``--signal=USR1@grace`` before a requeue; training continues), and
on SIGTERM: during a step the stop waits for the step to finish (publish included) and
saves it; between steps (waiting for a batch) the state is already consistent, so it is
saved at once (on a multi-rank FSDP trainer, whose DCP saves are collective, it stops without
saving: workers/trainer/dcp_state.py); then the loop's own SIGTERM path exits 143. There, the
ranks also agree after every step on the SIGUSR1 / SIGTERM flags: one signalled rank acts for
all. SIGKILL saves nothing: the run resumes from the last complete checkpoint and the steps
after it are redone (``steps_lost``).

Both plans' models (DTensor parameters: the FSDP plan and the tp/ep mesh plan) save through
torch.distributed.checkpoint instead (workers/trainer/dcp_state.py: one COLLECTIVE save per step,
under the HF names, reshardable, so the resume may run at another layout); the per-rank files
remain for models without DTensor parameters (one process, nothing sharded).

Resume (``load``): newest complete checkpoint (per-rank files: of the same world size); rank 0 cuts
``metrics.jsonl`` back to the records before the resume step (so the curve continues with
no duplicate steps; a checkpointed step's record that is missing or torn is put back from the copy
kept when it was saved: metrics_durable.py) and appends ``checkpoints/resumes.jsonl`` {step, steps_lost, skipped}. A
trainer restarted before any checkpoint (an earlier one published or recorded a step) resumes
from step 0 the same way: its metrics are cut to nothing and the redo is counted.
Rollout batches the resumed trainer needs again are kept: ``prune_bound``.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from workers.common.atomic_dir import seal
from workers.common.protocol import CHECKPOINTS_DIR, COMPLETE, METRICS_FILE, WEIGHTS_DIR, step_name
from workers.trainer import dcp_state, metrics_durable
from workers.trainer.batch import KEEP_ROLLOUTS

RESUMES_FILE = "resumes.jsonl"


def trainable_state(model) -> dict:
    """``model.state_dict()`` without frozen parameters (LoRA: the base is not checkpointed, the
    adapters are; workers/trainer/dcp_state.py ``frozen_options``)."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def complete_checkpoints(root: Path, world_size: int) -> list[int]:
    """Steps of complete checkpoints, oldest first: DCP ones of any world size (workers/trainer/dcp_state.py),
    per-rank ones with COMPLETE and every rank file of ``world_size``."""
    steps = []
    if not root.is_dir():
        return steps
    for d in root.iterdir():
        if not d.name.startswith("step_") or not (d / COMPLETE).exists():
            continue
        try:
            meta = json.loads((d / COMPLETE).read_text())
        except ValueError:
            continue
        if dcp_state.is_complete(d, meta) or (
                meta.get("world_size") == world_size and all((d / f"rank_{r}.pt").exists() for r in range(world_size))):
            steps.append(int(d.name[5:]))
    return sorted(steps)


class Checkpointer:
    """One per trainer rank. Hooks in the loop: ``load`` at start, ``begin_step`` /
    ``end_step`` around each step, ``on_stop`` in the SIGTERM path, ``prune_bound``."""

    def __init__(self, run_dir: Path, *, rank: int, world_size: int, every: int, keep: int,
                 log: Optional[logging.Logger] = None):
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.run_dir = Path(run_dir)
        self.rank, self.world_size, self.every, self.keep = rank, world_size, every, max(1, keep)
        self.log = log or logging.getLogger("trainer.checkpoint")
        self.root.mkdir(parents=True, exist_ok=True)
        self.resume_step = 0  # newest checkpointed step: a crash redoes the steps after it
        self.done_step = 0  # steps trained so far (the state the model holds between steps)
        self.in_step = False
        self.save_requested = self.stop_requested = False
        self._model = self._optimizer = None
        self._prev_term: Callable = signal.SIG_DFL

    # ---- signals ---------------------------------------------------------------------
    def install_signals(self, model, optimizer) -> None:
        """SIGUSR1: checkpoint after this step. SIGTERM: checkpoint, then the loop's handler
        (installed before this) stops the process. Call after the loop's own handler."""
        self._model, self._optimizer = model, optimizer
        self._prev_term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_usr1(self, signum, frame) -> None:
        self.save_requested = True

    def _on_term(self, signum, frame) -> None:
        if self.in_step:
            self.stop_requested = True  # end_step saves and stops
            return
        if self._model is not None and self._collective(self._model):
            # A DCP save is collective, and between steps the peers may be anywhere (one may
            # already be in the next step's barrier): stop without one rather than mismatch them.
            self.log.warning(f"SIGTERM between steps: no checkpoint on a {self.world_size}-rank FSDP trainer (its "
                             f"saves are collective); a resume redoes the steps after {self.resume_step}. Slurm's "
                             f"SIGUSR1 before a requeue (or a SIGTERM during a step) saves on every rank")
            self._stop(signum, frame)
        self._save_and_stop(signum, frame)

    def _collective(self, model) -> bool:
        return self.world_size > 1 and dcp_state.reshardable(model)

    def _save_and_stop(self, signum, frame) -> None:
        if self._model is not None and self.done_step > self.resume_step:
            self.save(self.done_step, self._model, self._optimizer)
        self._stop(signum, frame)

    def _stop(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, self._prev_term)
        if callable(self._prev_term):
            self._prev_term(signum, frame)  # the loop's TrainerStopped
        raise SystemExit(128 + signal.SIGTERM)

    # ---- loop hooks ------------------------------------------------------------------
    def begin_step(self) -> None:
        self.in_step = True

    def end_step(self, step: int, model, optimizer) -> None:
        """Step ``step`` (1-based) is trained and published: save if due or asked; stop if SIGTERM came."""
        self.done_step = step
        try:  # still "in step" while saving: a SIGTERM now waits for this save, then stops
            if self._collective(model):  # a signal that reached one rank saves / stops on all of them
                self.save_requested, self.stop_requested = dcp_state.agree(self.save_requested, self.stop_requested)
            if self.save_requested or (self.every > 0 and self.done_step % self.every == 0):
                self.save_requested = False
                self.save(self.done_step, model, optimizer)
        finally:
            self.in_step = False
        if self.stop_requested:
            self._save_and_stop(signal.SIGTERM, None)

    def prune_bound(self, step: int) -> int:
        """``newest`` for prune_rollouts: keep every batch a resume would redo (after ``resume_step``)."""
        return min(step, self.resume_step + KEEP_ROLLOUTS)

    # ---- save / load -----------------------------------------------------------------
    def save(self, step: int, model, optimizer) -> Path:
        """Write this rank's part of checkpoint ``step``; the last rank in publishes it."""
        t0 = time.perf_counter()
        final = self.root / step_name(step)
        if (final / COMPLETE).exists():
            return final  # the same step saved before a rewind: identical by construction
        if self.rank == 0:  # the metrics record of this step is as durable as the checkpoint (metrics_durable.py)
            metrics_durable.keep_record(self.run_dir / METRICS_FILE, self.root, step)
        tmp = self.root / f".{final.name}.tmp"
        if dcp_state.reshardable(model):  # the FSDP plan: one collective DCP save, resumable at another dp
            if dcp_state.save(tmp, final, step, model, optimizer, rank=self.rank, world_size=self.world_size):
                self.resume_step = max(self.resume_step, step)
                self._retain()
                self.log.info(f"checkpoint step {step} complete in {final} (DCP, {time.perf_counter() - t0:.2f}s)")
            return final
        tmp.mkdir(parents=True, exist_ok=True)
        state = {"model": trainable_state(model), "optimizer": optimizer.state_dict(), "step": step,
                 "rank": self.rank, "world_size": self.world_size,
                 "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
        part = tmp / f"rank_{self.rank}.pt.part"
        with open(part, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, tmp / f"rank_{self.rank}.pt")
        if all((tmp / f"rank_{r}.pt").exists() for r in range(self.world_size)):
            try:
                seal(tmp, final, COMPLETE, {"step": step, "world_size": self.world_size}, replace=False)
            except OSError:  # another rank published it first
                pass
            else:
                self.resume_step = step
                self._retain()
                self.log.info(f"checkpoint step {step} complete in {final} ({time.perf_counter() - t0:.2f}s)")
        self.resume_step = max(self.resume_step, step) if (final / COMPLETE).exists() else self.resume_step
        return final

    def _retain(self) -> None:
        steps = complete_checkpoints(self.root, self.world_size)
        for s in steps[:-self.keep]:
            shutil.rmtree(self.root / step_name(s), ignore_errors=True)
        if steps:
            for d in self.root.glob(".step_*.tmp"):  # abandoned partial saves older than the newest
                if int(d.name[6:-4]) < steps[-1]:
                    shutil.rmtree(d, ignore_errors=True)

    def load(self, model, optimizer) -> int:
        """Restore the newest complete checkpoint; returns the step to start at (0: none)."""
        skipped = [d.name for d in self.root.glob(".step_*.tmp")]
        step = self._load_newest(model, optimizer, skipped)
        if step is not None:
            self.resume_step = self.done_step = step
            if self.rank == 0:
                self._record_resume(step, skipped)
            return step
        if self.rank == 0 and self._restarted():  # no checkpoint, but an earlier trainer ran: it starts over
            self._record_resume(0, skipped)
        return 0

    def restore(self, model, optimizer) -> Optional[int]:
        """Put the newest complete checkpoint back into ``model`` and ``optimizer`` in the middle of
        a run (the loop's step counter goes on: no metrics rewind, no resume entry); its step, or
        None when there is none. COLLECTIVE for DCP checkpoints, like ``load``."""
        return self._load_newest(model, optimizer, [])

    def _load_newest(self, model, optimizer, skipped: list) -> Optional[int]:
        """Load the newest loadable complete checkpoint; its step (None: none). Appends what it skipped."""
        for step in reversed(complete_checkpoints(self.root, self.world_size)):
            if dcp_state.reshardable(model) != dcp_state.is_complete(self.root / step_name(step), self._meta(step)):
                skipped.append(step_name(step))  # the other plan's format (tp/ep changed): not loadable here
                continue
            path = self.root / step_name(step) / f"rank_{self.rank}.pt"
            if dcp_state.reshardable(model):  # collective: every rank loads the same step
                dcp_state.load(self.root / step_name(step), model, optimizer, rank=self.rank)
            else:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=False)
                    model.load_state_dict(state["model"], strict=dcp_state.frozen_options(model) is None)
                    optimizer.load_state_dict(state["optimizer"])
                except Exception as e:  # corrupt or mismatched: an older one may still do
                    self.log.warning(f"skipping checkpoint {path}: {type(e).__name__}: {e}")
                    skipped.append(step_name(step))
                    continue
                torch.set_rng_state(state["rng"]["torch"])
                np.random.set_state(state["rng"]["numpy"])
                random.setstate(state["rng"]["python"])
            return step
        return None

    def _restarted(self) -> bool:
        """An earlier trainer of this run got as far as publishing or recording a step (a first start
        finds neither: rank 0 publishes weights/step_0 after ``load``)."""
        weights = self.run_dir / WEIGHTS_DIR
        return (self.run_dir / METRICS_FILE).exists() or (weights.is_dir() and any(
            d.name.startswith("step_") for d in weights.iterdir()))

    def _record_resume(self, step: int, skipped: list) -> None:
        """Rank 0: cut the metrics of the steps to redo and append ``resumes.jsonl`` (every resume,
        from step 0 too, so each redone step is counted: benchmarks/chaos.py's steps_lost)."""
        lost = self._rewind_metrics(step)
        with open(self.root / RESUMES_FILE, "a") as fh:
            fh.write(json.dumps({"time": time.time(), "step": step, "steps_lost": lost, "skipped": skipped}) + "\n")
        where = f"checkpoint step {step}" if step else "step 0 (no checkpoint yet)"
        self.log.info(f"resumed from {where} ({lost} steps to redo; skipped {skipped or 'none'})")

    def _meta(self, step: int) -> dict:
        return json.loads((self.root / step_name(step) / COMPLETE).read_text())

    def _rewind_metrics(self, step: int) -> int:
        """Keep metrics records of steps <= ``step`` (those the checkpoint holds); returns how many
        later ones were cut."""
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return 0
        kept, cut = [], 0
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if not isinstance(rec, dict) or type(rec.get("step")) is not int:
                continue  # not a step record: nothing of ours
            if rec["step"] <= step:
                kept.append(line)
            else:
                cut += 1
        kept, back = metrics_durable.restore_records(kept, self.root, step)
        if back:
            self.log.warning(f"metrics.jsonl lacked the records of checkpointed steps {back} (a cut or torn line): "
                             f"put back from {self.root / metrics_durable.BACKUP_FILE}")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        return cut
