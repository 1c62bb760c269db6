"""Login-node check of ``algorithm.teacher.path`` (on-policy distillation), torch-free.

The teacher scores the tokens the student sampled, so both must speak the same token ids: a
teacher whose tokenizer differs (another vocabulary, or the same size with other ids) would
score nonsense and the reverse KL would still look like a number. Refused here, before anything
starts: the teacher's config.json must describe a model family this project builds, its
vocabulary size must equal the student's, and where both sides have a tokenizer file the two
must be identical (token -> id tables and added tokens).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.resources import PlanError
from workers.common.config import RunConfig
from workers.models.hf_dir import CheckpointError, model_fields, tokenizer_vocab, weight_map


def _tokens(directory: Path) -> Optional[tuple[dict, list]]:
    """(vocab, added tokens) of ``directory``'s tokenizer.json or vocab.json; None without one."""
    for name in ("tokenizer.json", "vocab.json"):
        path = directory / name
        if path.is_file():
            data = json.loads(path.read_text())
            if name == "vocab.json":
                return data, []
            added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
            return (data.get("model") or {}).get("vocab"), added
    return None


def student_tokenizer_dir(cfg: RunConfig) -> Optional[Path]:
    """Where the student's tokenizer lives (``model.path``, or the converted ``model.pretrained``)."""
    from workers.models.pretrained import tokenizer_dir

    found = tokenizer_dir(cfg.model)
    return found if found is not None and tokenizer_vocab(found) is not None else None


def check_teacher(cfg: RunConfig) -> None:
    """PlanError unless the teacher is a usable checkpoint with the student's tokenizer (no-op without one)."""
    path = cfg.algorithm.teacher.path
    if not path:
        return
    directory = Path(path).expanduser().resolve()
    try:
        _spec, fields = model_fields(directory)
        weight_map(directory)
    except CheckpointError as e:
        raise PlanError(f"algorithm.teacher.path: {str(e).replace('model.path=', '')}") from None
    student = cfg.model.vocab_size
    if fields.get("vocab_size") != student:
        raise PlanError(f"algorithm.teacher.path={path}: the teacher's vocab_size is {fields.get('vocab_size')} "
                        f"({directory}/config.json), the student's model.vocab_size is {student}: the teacher must use "
                        f"the student's tokenizer")
    mine = student_tokenizer_dir(cfg)
    theirs = _tokens(directory)
    if mine is not None and theirs is not None and _tokens(mine) != theirs:
        raise PlanError(f"algorithm.teacher.path={path}: its tokenizer differs from the student's ({mine}): the "
                        f"teacher would score other tokens than the student sampled")
