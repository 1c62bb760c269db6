"""A Hugging Face checkpoint directory (``model.path``), read torch-free: what the launcher checks.

A directory in HF layout is the unit of model input and output (docs/design.md, "Models and the trainer")::

    config.json                      architectures, model_type and the architecture fields
    model.safetensors                one file, or
    model.safetensors.index.json     {"metadata": ..., "weight_map": {tensor name: shard file}}
    model-00001-of-00003.safetensors ...the shards it names
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   optional

Why torch-free: the launcher (which never imports torch, tests/unit/repo/test_import_graph.py) reads
config.json to choose the family and fill ``model.*``, and refuses a bad directory before anything
starts, naming the file and the key. The tensors themselves (names, shapes, FP8 scales) are read
by workers/models/hf_checkpoint.py, which needs torch; safetensors headers are plain JSON, so the
weight map is listed here without it.

Families map config.json through their spec's ``from_hf_config`` / ``to_hf_config``
(workers/models/hf_config.py HfConfigMap, or the family's own module).
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Optional

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
"""Files copied next to every published step when the source directory has them."""
MAX_HEADER = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used; the message names the file and the key."""


def _json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {what} (a Hugging Face checkpoint directory has one)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_config(directory: Path | str) -> dict:
    """config.json of ``directory`` as a dict; CheckpointError for a missing dir or a bad file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"model.path={directory} is not a directory")
    config = _json(directory / CONFIG, CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory / CONFIG}: not a JSON object")
    return config


def spec_for(config: dict, where: Path | str):
    """The ModelSpec whose ``hf_architectures`` holds config.json's ``architectures`` entry."""
    from workers.common.registry import MODELS

    arches = config.get("architectures")
    if not (isinstance(arches, list) and len(arches) == 1 and isinstance(arches[0], str)):
        raise CheckpointError(f"{where}: key 'architectures' must be a list of one class name, got {arches!r}")
    supported = {a: s for s in MODELS.specs() for a in s.hf_architectures if s.from_hf_config is not None}
    if arches[0] in supported:
        return supported[arches[0]]
    why_not = []
    for spec in MODELS.specs():  # no native family: the generic path, when transformers can build it
        if spec.catch_all is not None:
            takes, why = spec.catch_all(config)
            if takes:
                return spec
            why_not.append(why)
    raise CheckpointError(f"{where}: architectures={arches} is not supported; supported architectures: "
                          f"{sorted(supported) or 'none registered'}" + "".join(f"; {w}" for w in why_not))


def model_fields(directory: Path | str) -> tuple[Any, dict]:
    """(family spec, {model field: value}) of a checkpoint directory, from its config.json."""
    directory = Path(directory)
    config = read_config(directory)
    spec = spec_for(config, directory / CONFIG)
    check_quantization(config, directory / CONFIG)
    # block FP8 / MXFP4 is how the weights are stored, not what the model computes: the loader dequantises it
    computed = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        fields = spec.from_hf_config(computed)
    except ValueError as e:
        raise CheckpointError(f"{directory / CONFIG}: {str(e).removeprefix(CONFIG + ': ')}") from None
    return spec, fields


def check_quantization(config: dict, where: Path | str) -> None:
    """Two quantized layouts are read (and dequantised by workers/models/hf_checkpoint.py): DeepSeek-style
    block FP8 (``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128x128 block) and GPT-OSS's MXFP4
    experts (``quant_method: mxfp4``, ``X_blocks`` + ``X_scales``: workers/models/mxfp4.py); any other
    ``quantization_config`` is refused."""
    q = config.get("quantization_config")
    if q is None:
        return
    fp8 = isinstance(q, dict) and q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3" \
        and list(q.get("weight_block_size") or []) == [128, 128]
    mx = isinstance(q, dict) and q.get("quant_method") == "mxfp4"
    if not (fp8 or mx):
        raise CheckpointError(f"{where}: quantization_config={q!r} is not supported; only block FP8 "
                              f"(quant_method fp8, fmt e4m3, weight_block_size [128, 128]) and MXFP4 (quant_method "
                              f"mxfp4, GPT-OSS) are dequantised on load")


def read_st_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> {dtype, shape, data_offsets}), torch-free."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is implausible (corrupt file?)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a weight file of the checkpoint)") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def weight_map(directory: Path | str) -> dict[str, str]:
    """{tensor name: file name} of a checkpoint: the index's weight_map (every named shard must
    exist), else the single model.safetensors' header. CheckpointError names the file and key."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        data = _json(index, INDEX)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and v for v in wm.values()):
            raise CheckpointError(f"{index}: key 'weight_map' must map tensor names to shard file names")
        for file in sorted(set(wm.values())):
            if not (directory / file).is_file():
                name = next(k for k, v in wm.items() if v == file)
                raise CheckpointError(f"{index}: weight_map[{name!r}] names shard {file}, which is missing "
                                      f"from {directory}")
        return dict(wm)
    if (directory / SINGLE).is_file():
        return {name: SINGLE for name in read_st_header(directory / SINGLE)}
    raise CheckpointError(f"{directory}: no {SINGLE} and no {INDEX} (the weights of a Hugging Face checkpoint)")


def tokenizer_files(directory: Path | str) -> list[str]:
    """Tokenizer (and generation config) files present in ``directory``, in TOKENIZER_FILES order."""
    directory = Path(directory)
    return [f for f in TOKENIZER_FILES if (directory / f).is_file()]


def has_tokenizer(directory: Path | str) -> bool:
    return any(f in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in tokenizer_files(directory))


def read_tokenizer_json(path: Path) -> dict:
    """A ``tokenizer.json`` as a dict, after checking it is one (a JSON object whose ``model`` holds a
    ``vocab``, as every ``tokenizers`` model type writes it); CheckpointError naming the file otherwise."""
    data = _json(path, "tokenizer.json")
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), (dict, list)):
        raise CheckpointError(f"{path}: not a tokenizer (a tokenizer.json is a JSON object whose 'model' holds a "
                              f"'vocab', as the tokenizers library writes it)")
    if not isinstance(data.get("added_tokens") or [], list):
        raise CheckpointError(f"{path}: key 'added_tokens' must be a list of tokens")
    return data


def tokenizer_vocab(directory: Path | str) -> Optional[tuple[int, str]]:
    """(token ids the tokenizer can emit = highest id + 1, the file that says so), or None when the
    directory has no tokenizer.json / vocab.json (a SentencePiece model is not parsed here)."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if path.is_file():
        data = read_tokenizer_json(path)
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t.get("id", -1) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
        return _highest(ids, path) + 1, str(path)
    path = directory / "vocab.json"
    if path.is_file():
        vocab = _json(path, "vocab.json")
        if not isinstance(vocab, dict):
            raise CheckpointError(f"{path}: not a vocabulary (a JSON object of token -> id)")
        return _highest(list(vocab.values()), path) + 1, str(path)
    return None


def _highest(ids: list, path: Path) -> int:
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise CheckpointError(f"{path}: token ids must be integers, found {bad[0]!r}")
    return max(ids, default=-1)


def check_tokenizer(directory: Path | str, vocab_size: int) -> None:
    """A tokenizer whose ids exceed the embedding would index past it: refused, naming both files."""
    found = tokenizer_vocab(directory)
    if found is not None and found[0] > vocab_size:
        raise CheckpointError(f"{found[1]}: the tokenizer has {found[0]} token ids but {Path(directory) / CONFIG} "
                              f"vocab_size is {vocab_size} (the embedding): ids >= {vocab_size} cannot be embedded")


def check_directory(directory: Path | str, model_cfg) -> None:
    """Everything the launcher can check without torch: config.json's family and fields equal the
    ``model`` section, the weight files the index names exist, the tokenizer fits the embedding."""
    spec, fields = model_fields(directory)
    if spec.name != model_cfg.family:
        raise CheckpointError(f"{Path(directory) / CONFIG}: architectures={read_config(directory)['architectures']} is "
                              f"family {spec.name}, but model.family={model_cfg.family}")
    for key, value in fields.items():
        have = getattr(model_cfg, key)
        if have != value and not (isinstance(value, float) and math.isclose(have, value, rel_tol=1e-9)):
            raise CheckpointError(f"model.{key}={have!r} contradicts {Path(directory) / CONFIG} ({value!r})")
    weight_map(directory)
    check_tokenizer(directory, model_cfg.vocab_size)
