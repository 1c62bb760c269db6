"""Login-node check of ``algorithm.teacher.path`` (on-policy distillation), torch-free.

The teacher scores the tokens the student sampled, so both must speak the same token ids: a
teacher whose tokenizer differs (another vocabulary, or the same size with other ids) would
score nonsense and the reverse KL would still look like a number. Refused here, before anything
starts: the teacher's config.json must describe a model family this project builds, its
vocabulary size must equal the student's, and where both sides have a tokenizer file the two
must be identical (token -> id tables and added tokens).

A teacher is also read deeply enough that it cannot fail later and be blamed on something else:
its tokenizer.json must be a tokenizer, its context (``max_position_embeddings``) must hold the
longest sequence the run can produce, and its weight files must be whole and finite
(workers/models/weight_integrity.py: headers against file sizes, then the float values, scanned whole
up to 512 MiB and sampled per tensor above). NaN teacher weights would otherwise surface as a
NaN loss in the trainer, long after this launcher returned.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from launcher.activations import longest_sample
from launcher.resources import PlanError
from workers.common.config import RunConfig
from workers.models.hf_dir import CheckpointError, model_fields, read_config, read_tokenizer_json, tokenizer_vocab
from workers.models.weight_integrity import check_weights


def _tokens(directory: Path) -> Optional[tuple[dict, list]]:
    """(vocab, added tokens) of ``directory``'s tokenizer.json or vocab.json; None without one."""
    for name in ("tokenizer.json", "vocab.json"):
        path = directory / name
        if path.is_file():
            if name == "vocab.json":
                return json.loads(path.read_text()), []
            data = read_tokenizer_json(path)
            added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
            return (data.get("model") or {}).get("vocab"), added
    return None


def student_tokenizer_dir(cfg: RunConfig) -> Optional[Path]:
    """Where the student's tokenizer lives (``model.path``, or the converted ``model.pretrained``)."""
    from workers.models.pretrained import tokenizer_dir

    found = tokenizer_dir(cfg.model)
    return found if found is not None and tokenizer_vocab(found) is not None else None


def check_teacher(cfg: RunConfig) -> None:
    """PlanError unless the teacher is a usable checkpoint with the student's tokenizer (no-op without one).
    Cheapest first: config.json, vocabulary and context, tokenizer, then the weight files."""
    path = cfg.algorithm.teacher.path
    if not path:
        return
    directory = Path(path).expanduser().resolve()
    key = f"algorithm.teacher.path={path}"
    try:
        _spec, fields = model_fields(directory)
        student = cfg.model.vocab_size
        if fields.get("vocab_size") != student:
            raise PlanError(f"{key}: the teacher's vocab_size is {fields.get('vocab_size')} ({directory}/config.json), "
                            f"the student's model.vocab_size is {student}: the teacher must use the student's tokenizer")
        context = fields.get("max_position_embeddings", read_config(directory).get("max_position_embeddings"))
        longest, bound = longest_sample(cfg)
        if isinstance(context, int) and context < longest:
            raise PlanError(f"{key}: the teacher's max_position_embeddings is {context} ({directory}/config.json) "
                            f"but the run's sequences reach {longest} tokens ({bound}): the teacher must score whole "
                            f"sequences; use a teacher with a longer context or lower {bound}")
        theirs = _tokens(directory)
        mine = student_tokenizer_dir(cfg)  # the student's files were checked by check_model_path
        if mine is not None and theirs is not None and _tokens(mine) != theirs:
            raise PlanError(f"{key}: its tokenizer differs from the student's ({mine}): the teacher would score "
                            f"other tokens than the student sampled")
        check_weights(directory)  # every shard whole, every float finite
    except CheckpointError as e:
        raise PlanError(f"algorithm.teacher.path: {str(e).replace('model.path=', '')}") from None
