"""Fixed policies that score the tokens the student sampled: the KL reference and the distillation teacher.

- **reference** (``trainer.kl_coef`` > 0): the step-0 weights (``weights/step_0``, what the run
  started from), so the KL penalty measures drift from the user's checkpoint, not from the previous
  step. Not a second trainer copy: an inference engine's model that never takes a weight update.
- **teacher** (``algorithm=on_policy_distill``): any checkpoint with the student's tokenizer
  (launcher/teacher.py checks that), loaded from its Hugging Face directory.

Locally both are the model the embedded engine serves (workers/models/build.py
``model_from_config``) held by the orchestrator process; scoring one group is one forward over
its samples, run in a worker thread so the event loop keeps serving rollouts (torch releases the
GIL). The log-prob of completion token t is taken from the logits at t - 1, divided by the
sampling temperature, exactly as the trainer scores (workers/trainer/loss.py ``token_logprobs``).
Imports torch only when a run asks for one of them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import numpy as np

from workers.orchestrator.buffer import RolloutGroup


class PolicyScorer:
    """A model with fixed weights; :meth:`score` gives each sample's completion-token log-probs."""

    def __init__(self, model, temperature: float, what: str):
        self.model, self.temperature, self.what = model.eval(), temperature, what

    def score(self, group: RolloutGroup) -> list[np.ndarray]:
        """float32 log-probs of every completion token of each sample (env tokens included: not trained)."""
        import torch

        samples = group.samples
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        valid = torch.zeros(len(samples), width, dtype=torch.bool)
        for i, s in enumerate(samples):
            row = list(s.prompt_ids) + list(s.completion_ids)
            ids[i, :len(row)] = torch.tensor(row)
            valid[i, :len(row)] = True
        with torch.no_grad():
            logits = self.model(ids, attention_mask=valid).logits.float()
            logp = torch.log_softmax(logits[:, :-1] / self.temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        out = []
        for i, s in enumerate(samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            out.append(logp[i, p - 1:p - 1 + c].numpy().astype(np.float32))
        return out


REFERENCE_FILE = "reference_step0.safetensors"
"""The reference's tensors, kept in the run directory: weights/step_0 itself is pruned by weights.keep_last,
and a restarted orchestrator must score against the same policy."""


def reference_scorer(cfg: Any, weights_dir: Path, run_dir: Path) -> PolicyScorer:
    """The step-0 policy: the run's own model built as the embedded engine builds it, with ``weights_dir``'s
    tensors (the first time; copied to ``run_dir/REFERENCE_FILE`` for a restarted orchestrator)."""
    from safetensors.torch import load_file, save_file

    from workers.models.build import model_from_config
    from workers.weights.filesystem.receiver import load_step

    model = model_from_config(cfg.model, "float32")
    kept = Path(run_dir) / REFERENCE_FILE
    if kept.is_file():
        state = load_file(str(kept))
    else:
        state = load_step(weights_dir, expected=model.state_dict())
        tmp = kept.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        tmp.rename(kept)
    model.load_state_dict(state, strict=True)
    return PolicyScorer(model, cfg.orchestrator.temperature, "reference")


def teacher_scorer(cfg: Any) -> PolicyScorer:
    """The teacher of ``algorithm.teacher.path``: its family and sizes from its config.json."""
    from workers.models.build import model_from_config
    from workers.models.hf_checkpoint import load_pretrained
    from workers.models.hf_dir import model_fields

    directory = Path(cfg.algorithm.teacher.path).expanduser().resolve()
    spec, fields = model_fields(directory)
    teacher_cfg = spec.config(**{"name": directory.name, **fields, "family": spec.name, "path": str(directory)})
    model = load_pretrained(model_from_config(teacher_cfg, "float32"), teacher_cfg)
    return PolicyScorer(model, cfg.orchestrator.temperature, "teacher")


@dataclasses.dataclass
class Scorers:
    """What a run scores its groups with (either may be None)."""

    reference: Optional[PolicyScorer] = None
    teacher: Optional[PolicyScorer] = None

    @classmethod
    def for_run(cls, cfg: Any, step0: Path, run_dir: Path) -> "Scorers":
        return cls(reference=reference_scorer(cfg, step0, run_dir) if cfg.trainer.kl_coef > 0 else None,
                   teacher=teacher_scorer(cfg) if cfg.algorithm.teacher.path else None)

    def __bool__(self) -> bool:
        return self.reference is not None or self.teacher is not None

    def apply(self, group: RolloutGroup) -> None:
        """Put the reference's and the teacher's log-probs on each sample (blocking: call in a thread)."""
        if self.reference is not None:
            for s, lp in zip(group.samples, self.reference.score(group)):
                s.ref_logprobs = lp
        if self.teacher is not None:
            for s, lp in zip(group.samples, self.teacher.score(group)):
                s.teacher_logprobs = lp
