"""Resolve a published step into a self-contained Hugging Face directory (delta steps included).

    python -m workers.weights.filesystem.resolve RUN_DIR/weights/step_000007 OUT_DIR

A delta step's weight map points unchanged tensors at earlier steps' shards (hf_layout.py), a patch
step (``weights.delta``) holds only changed elements on top of its anchor (patch_reader.py); this
reads every tensor through our index.json (checksums and finiteness verified by the same reader
the inference workers use, workers/weights/filesystem/receiver.py), writes them into one
``model.safetensors`` and copies config.json and the tokenizer files: the result loads in
transformers and SGLang like a full step. A step of the default model (tiny_moe, which publishes no
config.json) becomes a ``MixtralForCausalLM`` directory: Mixtral's names and config.json, the byte
tokenizer where the run's vocabulary has it (workers/models/tiny_moe/hf_export.py). Peak memory is the model once (a tool, not a role).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from workers.common.protocol import STABLE, step_name
from workers.weights.delta import FORMAT as DELTA_FORMAT
from workers.weights.filesystem.layout import INDEX
from workers.models.hf_dir import CONFIG, INDEX as HF_INDEX, TOKENIZER_FILES
from workers.weights.base import WeightLoadError
from workers.weights.filesystem.receiver import DiskReader
from workers.weights.lora_format import is_adapter_dir
from workers.weights.lora_steps import adapter_dirs
from workers.weights.shards import write_shard


def resolve(step_dir: Path, out_dir: Path) -> Path:
    """Write the full checkpoint of ``step_dir`` into ``out_dir`` (created; must not exist)."""
    step_dir, out_dir = Path(step_dir), Path(out_dir)
    several = adapter_dirs(step_dir)
    if several:  # trainer.lora.adapters: one merged model per adapter, so the caller names it
        raise WeightLoadError(f"{step_dir} holds several LoRA adapters {sorted(several)}: resolve one of "
                              f"{step_dir}/adapters/<name>")
    if is_adapter_dir(step_dir):  # a LoRA step: merged into its base (workers/weights/lora_merge.py)
        from workers.weights.lora_merge import merge

        return merge(step_dir, out_dir)
    files_dir = _anchor_of(step_dir)  # a patch step (weights.delta) takes config and tokenizer from its anchor
    mixtral = None
    if not (files_dir / CONFIG).is_file():
        mixtral = _tiny_moe_of(step_dir)
        if mixtral is None:
            raise WeightLoadError(f"{files_dir} has no {CONFIG}: its family publishes no Hugging Face config")
    reader = DiskReader()
    loaded = reader.load(step_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    state = sorted((n, t.contiguous()) for n, t in loaded.state.items())
    if mixtral is not None:
        return _write_mixtral(mixtral, state, out_dir)
    write_shard(out_dir / "model.safetensors", state, {"format": "pt"})
    total = sum(t.numel() * t.element_size() for _, t in state)
    index = {"metadata": {"total_size": total}, "weight_map": {n: "model.safetensors" for n, _ in state}}
    (out_dir / HF_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    for name in (CONFIG, *TOKENIZER_FILES, STABLE):
        if (files_dir / name).is_file():
            shutil.copyfile(files_dir / name, out_dir / name)
    return out_dir


def _tiny_moe_of(step_dir: Path):
    """The model section of a tiny_moe run whose step this is (RUN_DIR/weights/step_N: the run's
    config/run.yaml), else None: such steps resolve into Mixtral directories (tiny_moe/hf_export.py)."""
    run_yaml = step_dir.parent.parent / "config" / "run.yaml"
    if not run_yaml.is_file():
        return None
    from workers.common.config.run import load_run_config

    model = load_run_config(str(run_yaml)).model
    return model if model.family == "tiny_moe" else None


def _write_mixtral(model, state: list, out_dir: Path) -> Path:
    """A tiny_moe step as ``MixtralForCausalLM`` (its function, Mixtral's names) with the byte tokenizer."""
    from workers.models.tiny_moe.hf_export import mixtral_config, mixtral_name
    from workers.weights.filesystem.byte_tokenizer import byte_tokenizer_files, wants_byte_tokenizer

    state = sorted((mixtral_name(n), t) for n, t in state)
    write_shard(out_dir / "model.safetensors", state, {"format": "pt"})
    dtype = str(state[0][1].dtype).removeprefix("torch.")
    (out_dir / CONFIG).write_text(json.dumps({**mixtral_config(model), "dtype": dtype}, indent=1) + "\n")
    for name, text in byte_tokenizer_files() if wants_byte_tokenizer(model) else ():
        (out_dir / name).write_text(text)
    return out_dir


def _anchor_of(step_dir: Path) -> Path:
    """The anchor step of a patch step (its full step: config.json and tokenizer live there), else itself."""
    try:
        index = json.loads((step_dir / INDEX).read_text())
    except (OSError, ValueError):
        return step_dir
    if isinstance(index, dict) and index.get("format") == DELTA_FORMAT and isinstance(index.get("anchor"), int):
        return step_dir.parent / step_name(index["anchor"])
    return step_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.weights.filesystem.resolve", description=__doc__.split("\n")[0])
    p.add_argument("step_dir")
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    try:
        print(resolve(Path(args.step_dir), Path(args.out_dir)), flush=True)
    except (WeightLoadError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
