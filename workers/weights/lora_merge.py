"""Merge a published LoRA step into its base: a Hugging Face directory transformers and SGLang load
without peft (``slurmrl export --merge RUN_OR_STEP OUT``; the launcher runs this module, it needs torch).

    python -m workers.weights.lora_merge RUN_DIR|STEP_DIR OUT_DIR [--base BASE_DIR] [--adapter NAME]

Which step: a step directory holding an adapter (workers/weights/lora_format.py), or a run directory
(its newest STABLE adapter step under ``weights/``). A run of several adapters (``trainer.lora.adapters``)
publishes ``step_N/adapters/<name>/``: name one with ``--adapter NAME`` (or pass that directory), one
merged model per adapter. Which base: ``--base``, else the adapter's
``base_model_name_or_path`` when that is a directory here, else the run's ``weights/step_000000``
(the published base). The base is read file by file and written with the SAME file names, index
and config (one safetensors file in memory at a time), each adapted tensor ``W + (alpha / r) B @ A``
computed in float32 and cast back to W's dtype -- the sum ``peft``'s ``merge_and_unload`` forms.

Expert adapters land wherever the base keeps the experts: per-expert tensors (``...experts.7.gate_proj
.weight``, the hub's and our published layout: the gate rows of the fused ``gate_up_proj`` delta go to
``gate_proj``, the rest to ``up_proj``) or stacked ones (``...experts.gate_up_proj``). Every adapter
target must find its tensors in the base, or nothing is written. Files of our weight layout that would
be stale after the merge (``index.json`` with per-tensor hashes, ``STABLE``) are not copied.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from workers.common.protocol import STABLE, WEIGHTS_DIR, is_marked
from workers.weights.filesystem.layout import INDEX as LAYOUT_INDEX
from workers.weights.lora_format import Adapter, is_adapter_dir, read_adapter
from workers.weights.lora_steps import ADAPTERS_DIR, adapter_dirs

SKIP_FILES = {LAYOUT_INDEX, STABLE}


def find_step(source: Path, adapter: Optional[str] = None) -> Path:
    """The adapter directory of ``source``: a step dir, one adapter's dir (``step_N/adapters/NAME``), or a
    run dir's newest STABLE adapter step; a step of several adapters (``trainer.lora.adapters``) needs
    ``adapter`` (one merged model per adapter)."""
    source = Path(source)
    if not is_adapter_dir(source) and not adapter_dirs(source):
        root = source / WEIGHTS_DIR
        steps = sorted((d for d in root.glob("step_*") if d.name[5:].isdigit() and is_marked(d)
                        and (is_adapter_dir(d) or adapter_dirs(d))), key=lambda d: int(d.name[5:])) \
            if root.is_dir() else []
        if not steps:
            raise FileNotFoundError(f"export --merge: {source} is neither a LoRA step directory (adapter_config.json "
                                    f"+ adapter_model.safetensors) nor a run directory with a STABLE adapter step in "
                                    f"{root}")
        source = steps[-1]
    several = adapter_dirs(source)
    if not several:
        if adapter is not None and source.parent.name == ADAPTERS_DIR and source.name != adapter:
            raise ValueError(f"export --merge: {source} is adapter {source.name!r}, not --adapter {adapter!r}")
        if adapter is not None and source.parent.name != ADAPTERS_DIR:
            raise ValueError(f"export --merge: {source} holds one adapter; drop --adapter {adapter!r}")
        return source
    if adapter is None:
        raise ValueError(f"export --merge: {source} holds several LoRA adapters {sorted(several)}: name one with "
                         f"--adapter NAME (or pass {source}/{ADAPTERS_DIR}/NAME)")
    if adapter not in several:
        raise ValueError(f"export --merge: --adapter {adapter!r} is not in {source}: it holds {sorted(several)}")
    return several[adapter]


def find_base(step_dir: Path, adapter: Adapter, base: Optional[Path]) -> Path:
    """``base``, else the adapter's base_model_name_or_path if it is a directory, else the run's step 0."""
    if base is not None:
        return Path(base)
    if adapter.base_model and Path(adapter.base_model).is_dir():
        return Path(adapter.base_model)
    step = step_dir.parent.parent if step_dir.parent.name == ADAPTERS_DIR else step_dir  # step_N/adapters/NAME
    step0 = step.parent / "step_000000"
    if step0.is_dir():
        return step0
    raise FileNotFoundError(f"export --merge: no base for {step_dir}: base_model_name_or_path="
                            f"{adapter.base_model!r} is not a directory here and {step0} does not exist; pass --base")


def deltas(adapter: Adapter) -> dict[str, dict[str, torch.Tensor]]:
    """{target: {base tensor name: float32 delta}} for both the per-expert and the stacked layouts of experts."""
    out = {}
    for target in adapter.tensors:
        d = adapter.delta(target)
        if d.dim() == 2:
            out[target] = {f"{target}.weight": d}
            continue
        mod, _, stack = target.rpartition(".")
        names = {target: d}  # a base that keeps the stack itself
        for e in range(d.shape[0]):
            if stack == "gate_up_proj":
                inter = d.shape[1] // 2
                names[f"{mod}.{e}.gate_proj.weight"] = d[e, :inter]
                names[f"{mod}.{e}.up_proj.weight"] = d[e, inter:]
            else:
                names[f"{mod}.{e}.{stack}.weight"] = d[e]
        out[target] = names
    return out


def merge(source, out_dir, *, base: Optional[Path] = None, adapter_name: Optional[str] = None) -> Path:
    """Write ``base + adapter`` of ``source`` (module docstring; ``adapter_name``: which adapter of a step
    of several) into ``out_dir`` (must not exist)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    step_dir = find_step(Path(source), adapter_name)
    adapter = read_adapter(step_dir)
    base_dir = find_base(step_dir, adapter, base)
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"export --merge: base {base_dir} has no *.safetensors files")
    wanted = deltas(adapter)
    present = set()
    for f in files:
        with safe_open(str(f), "pt") as fh:
            present.update(fh.keys())
    missing = [t for t, names in wanted.items() if not (present & set(names))]
    if missing:
        raise ValueError(f"export --merge: {len(missing)} adapter targets have no tensor in base {base_dir}, e.g. "
                         f"{missing[:3]}: is it the checkpoint this adapter was trained on?")
    by_name = {n: d for names in wanted.values() for n, d in names.items() if n in present}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=False)
    for f in files:
        state = load_file(str(f))
        for name in state.keys() & by_name.keys():
            w = state[name]
            state[name] = (w.float() + by_name[name]).to(w.dtype).contiguous()
        save_file(state, str(out_dir / f.name), metadata={"format": "pt"})
    for f in base_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in SKIP_FILES:
            shutil.copyfile(f, out_dir / f.name)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="slurmrl export --merge", description=__doc__.split("\n")[0])
    p.add_argument("source", help="a LoRA step directory or a run directory (its newest adapter step)")
    p.add_argument("out", help="output directory (must not exist)")
    p.add_argument("--base", default=None, help="base checkpoint directory (default: the adapter's base, or step 0)")
    p.add_argument("--adapter", default=None, help="which adapter of a step of several (trainer.lora.adapters)")
    args = p.parse_args(argv)
    try:
        out = merge(args.source, args.out, base=Path(args.base) if args.base else None, adapter_name=args.adapter)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"slurmrl export: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
