"""What makes a published ``weights/step_N/`` a Hugging Face checkpoint directory (torch-free).

Besides our own ``index.json`` (checksums, read by our workers) and ``STABLE``, rank 0 writes,
before STABLE (so a step is either complete or absent):

- ``config.json``: the family's ``to_hf_config(model)`` (original architecture name) plus the
  ``dtype`` of the published tensors, so ``AutoModelForCausalLM.from_pretrained(step_dir)`` and
  SGLang build the same model;
- ``model.safetensors.index.json``: HF's ``{"metadata": {"total_size"}, "weight_map"}`` naming
  each tensor's shard (written for one shard too: tools that read only the index find it);
- the tokenizer files of the source checkpoint (``model.path``, or the converted
  ``model.pretrained`` directory), copied unchanged; a model without a tokenizer whose vocabulary
  holds the byte-level chat template's 264 ids gets that template's tokenizer files instead
  (byte_tokenizer.py), so every step can be prompted with ``AutoTokenizer.from_pretrained``.

Families without ``to_hf_config`` (tiny_moe: its Qwen3-MoE tensor names belong to an architecture with
q/k norms it lacks) publish steps without these files: ordinary safetensors, not loadable by
transformers as published; the plan's ``model path:`` line says so (workers/models/tiny_moe/spec.py
``NOT_HF``) and resolve.py writes such a step as a Mixtral directory (tiny_moe/hf_export.py).

Delta steps (``weights.delta``): the weight map of a delta step points unchanged tensors at an
earlier step's shard (``../step_000004/model-00001-of-00001.safetensors``); transformers follows
such paths, SGLang does not (it globs the step's own directory). A full step is written every
``weights.delta_full_every`` steps (and after a restart): those are self-contained. A delta step is
resolved into a self-contained directory with ``python -m workers.weights.filesystem.resolve
STEP_DIR OUT_DIR``. In delta mode every shard has a sharded name, never ``model.safetensors``:
transformers prefers that file over the index, and a delta step's own shard holds only the
tensors that changed.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional

from workers.models.hf_dir import CONFIG, INDEX as HF_INDEX, tokenizer_files
from workers.models.pretrained import tokenizer_dir
from workers.weights.filesystem.byte_tokenizer import byte_tokenizer_files, wants_byte_tokenizer


@dataclasses.dataclass(frozen=True)
class HFFiles:
    """The HF side of every step of a run: its config.json and where its tokenizer files come from."""

    config: dict
    """The family's to_hf_config(model); ``dtype`` is added per step."""
    source: Optional[Path] = None
    """Directory the tokenizer files are copied from (None: no tokenizer)."""
    files: tuple[str, ...] = ()
    generated: tuple[tuple[str, str], ...] = ()
    """(file name, text) written into every step: the byte-level tokenizer of a model without one
    (byte_tokenizer.py), so the published step can be prompted with AutoTokenizer."""

    def write(self, step_tmp: Path, weight_map: dict[str, str], total_size: int, dtype: str) -> None:
        """config.json, model.safetensors.index.json and the tokenizer files into ``step_tmp``."""
        (step_tmp / CONFIG).write_text(json.dumps({**self.config, "dtype": dtype}, indent=1) + "\n")
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (step_tmp / HF_INDEX).write_text(json.dumps(index, indent=1) + "\n")
        for name in self.files:
            shutil.copyfile(self.source / name, step_tmp / name)
        for name, text in self.generated:
            (step_tmp / name).write_text(text)


def hf_files(model_cfg) -> Optional[HFFiles]:
    """The HFFiles of a run's model (None for a family without ``to_hf_config``)."""
    from workers.common.registry import MODELS

    spec = MODELS.get(model_cfg.family)
    if spec.to_hf_config is None:
        return None
    source = tokenizer_dir(model_cfg)
    generated = byte_tokenizer_files() if source is None and wants_byte_tokenizer(model_cfg) else ()
    return HFFiles(config=published_config(spec.to_hf_config(model_cfg)), source=source,
                   files=tuple(tokenizer_files(source)) if source else (), generated=generated)


def published_config(config: dict) -> dict:
    """The config.json of a published step: multi-token-prediction layers are not built, so a step
    has none of their tensors and says so (``num_nextn_predict_layers: 0``): SGLang's NEXTN draft
    model would otherwise look for layers the step does not hold."""
    if config.get("num_nextn_predict_layers"):
        return {**config, "num_nextn_predict_layers": 0}
    return config
