"""``weights.skip_nonfinite=true``: a step whose weights turn NaN or inf is skipped, never stalled on.

Without this the publisher's gate kept NaN weights off the inference workers but the trainer
trained on from its NaN state: every later step was refused too, the workers stayed on an
old version, the orchestrator's staleness bound stopped its rollouts, and nothing was logged
until ``trainer.batch_timeout_s`` blamed the orchestrator; a SIGTERM then checkpointed the NaN
state and the restarted trainer repeated it all.

Per step, after ``train_step`` and before the publish (:meth:`DivergenceGuard.check`): one
finiteness pass over this rank's parameter shards and optimizer state (one flag, one host
sync) and one all-reduce of it, so every rank decides alike. On NaN/inf:

- a warning names the step, the first bad tensor and the restore, every time;
- the newest complete checkpoint is put back (``Checkpointer.restore``; collective for DCP
  checkpoints). :meth:`DivergenceGuard.ensure_restore_point` saves one before the first step
  when the run has none, so there always is a finite state to go back to;
- the restored, finite state is then published as this step's version (the non-finite one
  never is; a version left out would stall the orchestrator's staleness bound just the same),
  and the step's metrics record says ``nonfinite_skipped: 1`` and ``restored_step``;
- after ``weights.max_nonfinite_skips`` skips with no clean checkpoint in between (a finite
  step, then a newer checkpoint) the run diverges whatever it restores: :class:`Diverged`, and
  the trainer exits ``EXIT_FATAL`` with that reason (workers/common/exits.py: the launcher does
  not restart it).

Non-finite state is never checkpointed: the loop's ``Checkpointer.end_step`` (a due save,
SIGUSR1, a SIGTERM during the step) runs after the restore. The steps between the restored
checkpoint and the skipped one are lost (``trainer.checkpoint_every_steps=1`` loses none).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from workers.weights.base import NonFiniteWeights


class Diverged(NonFiniteWeights):
    """Too many consecutive steps turned non-finite even after restoring: the run diverges (the
    message says how often, from which checkpoint, and what to change)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(model, optimizer):
    """(name, local tensor) of every parameter and floating optimizer state tensor of this rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        yield n, _local(p.detach())
    for p, state in optimizer.state.items():
        for key, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point():
                yield f"optimizer {key} of {names.get(id(p), '?')}", _local(v)


def first_nonfinite(model, optimizer) -> Optional[str]:
    """Name of this rank's first non-finite tensor (None: all finite). One host sync on the fast
    path (every tensor finite); the names are looked up only when something is not."""
    tensors = list(_tensors(model, optimizer))
    if not tensors:
        return None
    device = tensors[0][1].device
    ok = torch.ones((), dtype=torch.bool, device=device)
    for _, t in tensors:
        if t.numel():
            ok &= torch.isfinite(t).all().to(device)
    if bool(ok):
        return None
    return next((n for n, t in tensors if t.numel() and not bool(torch.isfinite(t).all())), "?")


class DivergenceGuard:
    """One per trainer rank; a no-op unless ``weights.skip_nonfinite`` (then the publisher's own
    gate raises NonFiniteWeights and the trainer stops at the first non-finite step)."""

    def __init__(self, *, skip: bool, max_skips: int, ckpt, group=None, device=None,
                 log: Optional[logging.Logger] = None):
        self.skip, self.max_skips, self.ckpt = skip, max_skips, ckpt
        self.group, self.device = group, device
        self.log = log or logging.getLogger("slurmrl.trainer")
        self.count = 0  # non-finite steps not yet forgiven (see check)
        self.first_skipped: Optional[int] = None
        self.num_skipped = 0
        self.after_skip = False  # the previous step was skipped
        self.base = 0  # newest checkpoint right after the last skip (its end_step may save the restored state)
        self.clean = False  # a finite step trained since the last skip

    def ensure_restore_point(self, start: int, model, optimizer) -> None:
        """Before the first step: with no complete checkpoint yet, save the current (finite) state."""
        if not self.skip or self.ckpt.resume_step or start:
            return
        from workers.trainer.checkpoint import complete_checkpoints

        if not complete_checkpoints(self.ckpt.root, self.ckpt.world_size):
            self.ckpt.save(start, model, optimizer)

    def _agree(self, bad: bool) -> bool:
        """Every rank's flag, all-reduced (MAX): one rank's NaN makes every rank skip."""
        if self.group is None or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return bad
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def check(self, step: int, model, optimizer, stats: dict) -> None:
        """After ``train_step`` of ``step``: restore on NaN/inf (adding the metrics fields to
        ``stats``), or raise :class:`Diverged` once the skips are past the budget. COLLECTIVE.

        Skips count until a checkpoint of a cleanly trained state is saved after the last one
        (a finite step, then a newer checkpoint): a run that alternates (restored -> finite but
        huge -> NaN) or that only ever restores its restored state still reaches the budget."""
        if not self.skip:
            return
        if self.after_skip:
            self.base, self.after_skip, self.clean = self.ckpt.resume_step, False, False
        if self.count and self.clean and self.ckpt.resume_step > self.base:
            self.count, self.first_skipped = 0, None  # progress since the last skip is saved: forgiven
        name = first_nonfinite(model, optimizer)
        if not self._agree(name is not None):
            self.clean = True
            stats["nonfinite_skipped"] = 0
            return
        self.count += 1
        self.num_skipped += 1
        self.after_skip, self.clean = True, False
        self.first_skipped = self.first_skipped or step
        where = f"tensor {name}" if name else "another rank's tensors"
        if self.count > self.max_skips:
            raise Diverged(f"weights step {step} not published: {where} holds NaN or inf, the {self.count}th "
                           f"non-finite step in a row since step {self.first_skipped} (no clean checkpoint in "
                           f"between; each restored the newest checkpoint): the run diverges; lower trainer.lr "
                           f"(or raise weights.max_nonfinite_skips={self.max_skips})")
        restored = self.ckpt.restore(model, optimizer)
        if restored is None:  # ensure_restore_point saved one; only a deleted checkpoints dir gets here
            raise Diverged(f"weights step {step} not published: {where} holds NaN or inf and no checkpoint is "
                           f"left to restore")
        self.log.warning(f"step {step}: {where} holds NaN or inf after the optimizer step: not published; restored "
                         f"checkpoint step {restored} and publishing that state as v{step} (skip {self.count}"
                         f"/{self.max_skips} since the last clean checkpoint; weights.skip_nonfinite=true)")
        stats["nonfinite_skipped"] = 1
        stats["restored_step"] = restored
