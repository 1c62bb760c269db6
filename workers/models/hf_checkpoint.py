"""Stream a Hugging Face checkpoint directory (``model.path``) into a model, tensor by tensor.

Why streaming: a large MoE checkpoint does not fit one host's memory, and a rank needs only its
shard of it. :class:`HFCheckpoint` opens the safetensors files lazily (``safe_open``: a header
read, data memory-mapped) and returns one tensor, or one slice of one, at a time; DeepSeek-V3 /
Kimi block-FP8 weights (``X.weight`` float8_e4m3fn with ``X.weight_scale_inv`` float32, one scale
per 128x128 block) come back dequantised, slices included (only the scale blocks the slice
touches are read); GPT-OSS MXFP4 experts (``X_blocks`` + ``X_scales``, workers/models/mxfp4.py) come
back as the bf16 tensor ``X``. :func:`load_pretrained` is what a family's ``init`` calls: the model is built
on ``meta``, materialised with ``to_empty`` (nothing initialised twice), and each parameter is
filled from its checkpoint tensor, so no full state dict ever exists in memory.

Names go through the family's ``from_hf``, applied to ONE tensor at a time (a rename or a
per-tensor reshape; it may drop a tensor by returning nothing, e.g. MTP layers the model does not
build). Every problem raises :class:`CheckpointError` naming the file and the key: a tensor the
model needs and the checkpoint lacks, one the checkpoint has and the model does not, a shape that
differs, an FP8 weight without its scale.

Plan-time check (the launcher's child process; reads headers only, builds the model on meta)::

    python -m workers.models.hf_checkpoint check [PLUGIN ...] < model-section.yaml
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open

from workers.models import mxfp4
from workers.models.hf_dir import CheckpointError, read_config, read_st_header, weight_map

BLOCK = 128
SCALE = "_scale_inv"
FP8 = torch.float8_e4m3fn
Index = tuple[slice, ...]


class HFCheckpoint:
    """Lazy reader of one checkpoint directory: names, shapes, and tensors or slices on demand."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.files = weight_map(self.directory)  # {name: shard file}; missing shards refused here
        self._open: dict[str, object] = {}
        self._headers: dict[str, dict] = {}
        self.scaled = {n[: -len(SCALE)] for n in self.files if n.endswith(SCALE)}
        self.mxfp4 = {n[: -len(mxfp4.BLOCKS)] for n in self.files
                      if n.endswith(mxfp4.BLOCKS) and n[: -len(mxfp4.BLOCKS)] + mxfp4.SCALES in self.files}
        parts = {x + suffix for x in self.mxfp4 for suffix in (mxfp4.BLOCKS, mxfp4.SCALES)}
        self._logical = sorted({n for n in self.files if n not in parts and not (
            n.endswith(SCALE) and n[: -len(SCALE)] in self.files)} | self.mxfp4)

    def names(self) -> list[str]:
        """Logical tensor names (an FP8 weight's scale is part of it, an MXFP4 tensor's blocks and
        scales are one tensor under the name without the suffix)."""
        return list(self._logical)

    def where(self, name: str) -> str:
        """``<file>: tensor <name>`` for error messages."""
        file = self.files.get(name + mxfp4.BLOCKS if name in self.mxfp4 else name, "?")
        return f"{self.directory / file}: tensor {name!r}"

    def header(self, name: str) -> dict:
        file = self.files[name]
        if file not in self._headers:
            self._headers[file] = read_st_header(self.directory / file)
        entry = self._headers[file].get(name)
        if entry is None:
            raise CheckpointError(f"{self.where(name)} is listed in the index but absent from the file")
        return entry

    def shape(self, name: str) -> list[int]:
        if name in self.mxfp4:
            return mxfp4.logical_shape(list(self.header(name + mxfp4.BLOCKS)["shape"]))
        return list(self.header(name)["shape"])

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(self.directory / file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{self.directory / file}: cannot open ({e})") from None
        return self._open[file]

    def read(self, name: str, index: Optional[Index] = None) -> torch.Tensor:
        """Tensor ``name`` (``index``: one basic slice per leading dim; only those bytes are read),
        FP8 blocks dequantised to float32, MXFP4 ones to bfloat16."""
        if name in self.mxfp4:
            return self._mxfp4(name, index)
        if name not in self.files:
            raise CheckpointError(f"{self.directory}: no tensor {name!r} in the checkpoint")
        part = self._handle(name).get_slice(name)
        t = part[index] if index else part[:]
        if t.dtype == FP8:
            t = self._dequantise(name, t, index)
        return t

    def _mxfp4(self, name: str, index: Optional[Index]) -> torch.Tensor:
        """Dequantised MXFP4 tensor ``name`` (only the experts of ``index``'s first slice are read)."""
        blocks_name, scales_name = name + mxfp4.BLOCKS, name + mxfp4.SCALES
        blocks_shape = self.header(blocks_name)["shape"]
        if len(blocks_shape) < 3 or self.header(scales_name)["shape"] != blocks_shape[:-1]:
            raise CheckpointError(f"{self.where(name)}: MXFP4 {blocks_name} {blocks_shape} and {scales_name} "
                                  f"{self.header(scales_name)['shape']} do not fit ([..., out, G, 16] and [..., out, G])")
        lead = (index[0],) if index else (slice(None),)
        blocks = self._handle(blocks_name).get_slice(blocks_name)[lead]
        scales = self._handle(scales_name).get_slice(scales_name)[lead]
        t = mxfp4.dequantize(blocks, scales)
        return t[(slice(None), *index[1:])] if index and len(index) > 1 else t

    def _dequantise(self, name: str, w: torch.Tensor, index: Optional[Index]) -> torch.Tensor:
        scale_name = name + SCALE
        if scale_name not in self.files:
            raise CheckpointError(f"{self.where(name)} is float8_e4m3fn but {scale_name!r} (its per-block scales) "
                                  f"is missing")
        shape = self.shape(name)
        if len(shape) != 2:
            raise CheckpointError(f"{self.where(name)}: FP8 block scales need a 2-D weight, got shape {shape}")
        rows, cols = _bounds(index, shape)
        want = [-(-d // BLOCK) for d in shape]
        if self.shape(scale_name) != want:
            raise CheckpointError(f"{self.where(scale_name)} has shape {self.shape(scale_name)}; {BLOCK}x{BLOCK} "
                                  f"blocks of {name} {shape} need {want}")
        blocks = (slice(rows.start // BLOCK, -(-rows.stop // BLOCK)), slice(cols.start // BLOCK, -(-cols.stop // BLOCK)))
        s = self._handle(scale_name).get_slice(scale_name)[blocks].float()
        s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        r0, c0 = rows.start % BLOCK, cols.start % BLOCK
        return w.float() * s[r0: r0 + w.shape[0], c0: c0 + w.shape[1]]


def _bounds(index: Optional[Index], shape: list[int]) -> tuple[slice, slice]:
    """Concrete (start, stop) slices of the two dims of a 2-D tensor (steps are not supported)."""
    out = []
    for d in range(2):
        sl = index[d] if index and d < len(index) else slice(None)
        start, stop, step = sl.indices(shape[d])
        if step != 1:
            raise CheckpointError(f"slices with a step are not supported for FP8 weights ({sl})")
        out.append(slice(start, stop))
    return out[0], out[1]


def mapped_names(ckpt: HFCheckpoint, from_hf: Callable[[dict], dict]) -> Iterator[tuple[str, str, list[int]]]:
    """(checkpoint name, our name, our shape) of every checkpoint tensor ``from_hf`` keeps, found by
    applying it to a meta tensor of the checkpoint's shape (nothing is read)."""
    for hf_name in ckpt.names():
        out = from_hf({hf_name: torch.empty(ckpt.shape(hf_name), device="meta")})
        if len(out) > 1:
            raise CheckpointError(f"{ckpt.where(hf_name)}: the family's from_hf made {sorted(out)} of it; streaming "
                                  f"loads need one tensor per checkpoint tensor")
        for ours, t in out.items():
            yield hf_name, ours, list(t.shape)


def check_tensors(ckpt: HFCheckpoint, expected: dict[str, list[int]], from_hf: Callable[[dict], dict],
                  *, tied: bool = False) -> dict[str, str]:
    """{our name: checkpoint name} after checking names and shapes; CheckpointError otherwise."""
    plan: dict[str, str] = {}
    for hf_name, ours, shape in mapped_names(ckpt, from_hf):
        if ours not in expected:
            if tied and ours == "lm_head.weight":  # tied model: the embedding is the head
                continue
            raise CheckpointError(f"{ckpt.where(hf_name)} is unexpected: the model has no parameter {ours!r}")
        if shape != list(expected[ours]):
            raise CheckpointError(f"{ckpt.where(hf_name)} has shape {shape}; the model's {ours!r} is "
                                  f"{list(expected[ours])} (config.json and weights disagree?)")
        plan[ours] = hf_name
    missing = sorted(set(expected) - set(plan))
    if missing:
        raise CheckpointError(f"{ckpt.directory}: tensors missing from the checkpoint ({len(missing)}): "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return plan


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, model_cfg, from_hf: Optional[Callable[[dict], dict]] = None, *,
                    slices: Optional[Callable[[str], Optional[Index]]] = None,
                    full_shapes: Optional[dict[str, list[int]]] = None) -> torch.nn.Module:
    """Fill ``model`` (built on meta, or already allocated) from ``model_cfg.path``, tensor by tensor.

    A rank that holds shards passes ``full_shapes`` {our name: the unsharded shape} (checked against
    the checkpoint) and ``slices(our_name)``: the part of the checkpoint tensor its parameter holds
    (None: all of it); only that part is read. ``from_hf`` defaults to the family's
    ``checkpoint_from_hf(model_cfg)`` (its name map, tensors it does not build skipped)."""
    if from_hf is None:
        from workers.common.registry import MODELS

        from_hf = MODELS.get(model_cfg.family).checkpoint_from_hf(model_cfg)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    ckpt = HFCheckpoint(model_cfg.path)
    state = model.state_dict()
    expected = full_shapes or {n: list(t.shape) for n, t in state.items()}
    plan = check_tensors(ckpt, expected, from_hf, tied=getattr(model_cfg, "tie_word_embeddings", False))
    for ours, hf_name in plan.items():
        index = slices(ours) if slices is not None else None
        t = next(iter(from_hf({hf_name: ckpt.read(hf_name, index)}).values()))
        if list(t.shape) != list(state[ours].shape):
            raise CheckpointError(f"{ckpt.where(hf_name)} read as {index} is {list(t.shape)}; this rank's {ours!r} "
                                  f"is {list(state[ours].shape)}")
        state[ours].copy_(t)
    return model


def checkpoint_tensors(model: torch.nn.Module, model_cfg, from_hf: Callable[[dict], dict]):
    """``(our name, read)`` of every tensor of ``model_cfg.path`` the model holds, ``read()`` reading
    that one FULL tensor (FP8 dequantised) when called: the stream workers/trainer/parallel/mesh.py
    ``materialize`` fills a meta-built, sharded model from, so a rank reads only the tensors it
    holds (another EP rank's experts are never read) and keeps one at a time. Names and shapes are
    checked NOW, against ``model`` as built (full shapes: call this before sharding)."""
    ckpt = HFCheckpoint(model_cfg.path)
    expected = {n: list(t.shape) for n, t in model.state_dict().items()}
    plan = check_tensors(ckpt, expected, from_hf, tied=getattr(model_cfg, "tie_word_embeddings", False))

    def reader(hf_name: str):
        return lambda: next(iter(from_hf({hf_name: ckpt.read(hf_name)}).values()))
    return ((ours, reader(hf_name)) for ours, hf_name in plan.items())


def check_model_path(model_cfg) -> None:
    """The launcher's tensor check: the model built on meta against the headers (nothing read)."""
    from workers.common.registry import MODELS

    spec = MODELS.get(model_cfg.family)
    read_config(model_cfg.path)
    model = spec.build(model_cfg, device="meta")
    expected = {n: list(t.shape) for n, t in model.state_dict().items()}
    check_tensors(HFCheckpoint(model_cfg.path), expected, spec.checkpoint_from_hf(model_cfg),
                  tied=getattr(model_cfg, "tie_word_embeddings", False))


def main(argv: Optional[list[str]] = None) -> int:
    """``check [PLUGIN_MODULE ...]``: the model section (YAML) on stdin; exit 2 with the error on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "check":
        print("usage: python -m workers.models.hf_checkpoint check [PLUGIN ...] < model-section.yaml", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    from workers.common.config.run import structure_section
    from workers.common.plugins import load_plugins

    load_plugins(argv[1:])  # the run's plugins: a family they register builds here too
    model_cfg = OmegaConf.to_object(structure_section("model", OmegaConf.create(sys.stdin.read())))
    try:
        check_model_path(model_cfg)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{model_cfg.path}: every tensor present with its shape", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
