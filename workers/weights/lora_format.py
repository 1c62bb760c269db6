"""The published LoRA step: a PEFT adapter directory (issue 44). The contract between the trainer
(writer) and every reader (the embedded engine, SGLang's ``/load_lora_adapter``, ``slurmrl export
--merge``, users' ``peft.PeftModel.from_pretrained(base, step_dir)``).

Why PEFT's own format: a published step must load onto the user's ORIGINAL checkpoint with the
tools they already have, and the bugs users report with LoRA RL are layouts the other side cannot
read (SkyRL #1852: MoE adapters an engine could not load). So there is no layout of our own:
peft 0.21 (``target_parameters`` / ``ParamWrapper``) loads adapters on transformers 5's stacked
expert tensors, and this file writes exactly what ``PeftModel.save_pretrained`` writes for them.

Directory (``weights/step_N/`` in LoRA mode, or any directory :func:`write_adapter` is given)::

    adapter_config.json          peft LoraConfig fields (below), written before the tensors
    adapter_model.safetensors    the adapter tensors (PEFT key names, below), metadata {"format": "pt",
                                 "slurmrl_lora": "1", "slurmrl_step": "<N>"}

``adapter_config.json`` (keys peft reads; every other LoraConfig field is left to peft's default):
    ``peft_type: "LORA"``, ``task_type: "CAUSAL_LM"``, ``r`` (rank), ``lora_alpha`` (scale is
    ``lora_alpha / r``; ``use_rslora: false``), ``lora_dropout`` (the training dropout; written 0.0
    when experts are adapted, because peft's ParamWrapper refuses any other value and dropout does
    not exist at inference), ``target_modules`` (sorted leaf names of adapted ``nn.Linear`` modules:
    ``q_proj``, ``down_proj``, ... -- SGLang's LoRA loader reads the same list; never gate/up/down_proj on
    a MoE model: peft remaps those names onto the experts, workers/common/config/lora.py), ``target_parameters``
    (adapted stacked expert tensors, as module-path suffixes: ``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``; absent when no experts are adapted), ``base_model_name_or_path`` (the
    run's ``model.path``, or the step-0 base directory), ``bias: "none"``, ``fan_in_fan_out: false``,
    ``inference_mode: true``, ``init_lora_weights: true``, ``peft_version``.

Tensors, for a Hugging Face module path ``P`` (``model.layers.3.self_attn.q_proj``):
    dense ``nn.Linear`` [out, in]   ``base_model.model.P.lora_A.weight`` [r, in],
                                    ``base_model.model.P.lora_B.weight`` [out, r].
    stacked experts ``M.<stack>``   (M = ``model.layers.3.mlp.experts``; stacks ``gate_up_proj``
    [E, out, in]                    [E, 2I, H] or ``up_proj`` [E, I, H], then ``down_proj`` [E, H, I])
                                    ``base_model.model.M.<nest>lora_A.weight`` [E*r, in] and
                                    ``...lora_B.weight`` [out, r*E], where ``<nest>`` is
                                    ``base_layer.`` for the first stack of a module when two are
                                    adapted and empty for the last (peft nests one ParamWrapper per
                                    parameter, in the module's parameter order).
    The expert factors are flattened as peft flattens them: A row ``e*r + j`` is expert ``e``'s
    row ``j`` (``A.reshape(E, r, in)``), B column ``j*E + e`` is expert ``e``'s column ``j``
    (``B.reshape(out, r, E).permute(2, 0, 1)``). The delta of expert ``e`` is
    ``(alpha / r) * B_e @ A_e`` ([out, in]), as for a dense target.
    ``experts=shared_outer`` (one hidden-side factor shared by all experts) is published expanded to
    this per-expert layout (the shared factor repeated E times), so every reader sees one layout.
    dtype: float32 by default (the trainer's adapters; they are small), or as the caller asks.

In memory (:func:`write_adapter`'s input, :func:`read_adapter`'s output) an adapter is
``{target: (A, B)}``: ``target`` a Hugging Face module path (dense) or stacked parameter path
(``model.layers.3.mlp.experts.gate_up_proj``); A [r, in] / [E, r, in], B [out, r] / [E, out, r].
The router (``mlp.gate``) is never a target.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
STACK_ORDER = ("gate_up_proj", "up_proj", "down_proj")
"""Expert stacks in the order modules register them (workers/models/blocks/experts.py and
transformers 5): peft nests its wrappers in this order, so it fixes the ``base_layer.`` prefix."""
PEFT_VERSION = "0.21.2"


@dataclass
class Adapter:
    """A LoRA adapter in memory (module docstring): ``tensors`` {target: (A, B)} and its settings."""

    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float
    dropout: float = 0.0
    base_model: Optional[str] = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, target: str) -> torch.Tensor:
        """The weight update of ``target`` (float32): [out, in], or [E, out, in] for an expert stack."""
        a, b = self.tensors[target]
        return torch.matmul(b.float(), a.float()) * self.scale


def _stacked(target: str) -> bool:
    return target.rpartition(".")[2] in STACK_ORDER and ".experts." in f".{target}"


def _expert_keys(tensors: Mapping[str, tuple]) -> dict[str, str]:
    """{stacked target: its PEFT key stem (``base_model.model.M.[base_layer.]``)}."""
    by_module: dict[str, list[str]] = {}
    for t in tensors:
        if _stacked(t):
            mod, _, stack = t.rpartition(".")
            by_module.setdefault(mod, []).append(stack)
    out = {}
    for mod, stacks in by_module.items():
        stacks.sort(key=STACK_ORDER.index)
        for i, s in enumerate(stacks):
            out[f"{mod}.{s}"] = f"{PREFIX}{mod}." + "base_layer." * (len(stacks) - 1 - i)
    return out


def peft_state(adapter: Adapter, dtype: Optional[torch.dtype] = torch.float32) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT key names, expert factors flattened (module docstring)."""
    stems = _expert_keys(adapter.tensors)
    out = {}
    for target, (a, b) in adapter.tensors.items():
        a, b = a.detach(), b.detach()
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        if target in stems:
            if a.dim() != 3 or b.dim() != 3:
                raise ValueError(f"lora: expert target {target} needs A [E, r, in] and B [E, out, r], got "
                                 f"{tuple(a.shape)} and {tuple(b.shape)}")
            e, r, _ = a.shape
            out[stems[target] + "lora_A.weight"] = a.reshape(e * r, -1).contiguous()
            out[stems[target] + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
        else:
            out[f"{PREFIX}{target}.lora_A.weight"] = a.contiguous()
            out[f"{PREFIX}{target}.lora_B.weight"] = b.contiguous()
    return out


def _number(x: float):
    """An integral alpha as an int (peft's and SGLang's configs carry ints), else the float."""
    return int(x) if float(x).is_integer() else float(x)


def peft_config(adapter: Adapter) -> dict:
    """``adapter_config.json``'s content (module docstring)."""
    dense = sorted({t.rpartition(".")[2] for t in adapter.tensors if not _stacked(t)})
    experts = sorted({".".join(t.split(".")[-3:]) for t in adapter.tensors if _stacked(t)},
                     key=lambda s: (s.rpartition(".")[0], STACK_ORDER.index(s.rpartition(".")[2])))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(adapter.rank),
           "lora_alpha": _number(adapter.alpha), "lora_dropout": 0.0 if experts else float(adapter.dropout),
           "target_modules": dense, "base_model_name_or_path": adapter.base_model, "bias": "none",
           "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
           "peft_version": PEFT_VERSION}
    if experts:
        cfg["target_parameters"] = experts
    return cfg


def write_adapter(step_dir, adapter: Adapter, *, step: Optional[int] = None,
                  dtype: Optional[torch.dtype] = torch.float32) -> Path:
    """Write ``adapter`` into ``step_dir`` (created) as the PEFT directory of the module docstring.
    Each file goes to a temporary name and is renamed into place, config first: a reader that sees
    ``adapter_model.safetensors`` sees a complete adapter. Returns ``step_dir``."""
    from safetensors.torch import save_file

    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True, exist_ok=True)
    tmp = step_dir / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(peft_config(adapter), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, step_dir / CONFIG_FILE)
    meta = {"format": "pt", "slurmrl_lora": "1"}
    if step is not None:
        meta["slurmrl_step"] = str(int(step))
    tmp = step_dir / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    save_file(peft_state(adapter, dtype), str(tmp), metadata=meta)
    os.replace(tmp, step_dir / WEIGHTS_FILE)
    return step_dir


def is_adapter_dir(path) -> bool:
    """True when ``path`` holds a PEFT LoRA adapter (both files)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()


def from_peft_state(state: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-named tensors (:func:`peft_state`'s output, or peft's own) back to ``{target: (A, B)}``."""
    rank = int(config["r"])
    suffixes = list(config.get("target_parameters") or [])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if not key.startswith(PREFIX) or not key.endswith(".weight"):
            raise ValueError(f"lora: unexpected tensor {key!r} in the adapter (expected {PREFIX}...lora_A/B.weight)")
        stem, which = key[len(PREFIX):-len(".weight")].rsplit(".", 1)
        if which not in ("lora_A", "lora_B"):
            raise ValueError(f"lora: unexpected tensor {key!r} in the adapter (not lora_A / lora_B)")
        pairs.setdefault(stem, {})[which] = t
    out = {}
    for stem, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"lora: {stem} has {sorted(ab)} but needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        mod, depth = stem, 0
        while mod.endswith(".base_layer"):
            mod, depth = mod[:-len(".base_layer")], depth + 1
        stacks = sorted({s.rpartition(".")[2] for s in suffixes if f"{mod}.{s.rpartition('.')[2]}".endswith(s)},
                        key=STACK_ORDER.index)
        if not stacks:  # a dense nn.Linear
            out[stem] = (a, b)
            continue
        if depth >= len(stacks):
            raise ValueError(f"lora: {stem} nests {depth} base_layer levels but {mod} adapts {stacks}")
        e = a.shape[0] // rank
        a3 = a.reshape(e, rank, a.shape[1])
        b3 = b.reshape(b.shape[0], rank, e).permute(2, 0, 1)
        out[f"{mod}.{stacks[len(stacks) - 1 - depth]}"] = (a3, b3)
    return out


def read_adapter(step_dir, *, device: str = "cpu") -> Adapter:
    """Read a PEFT adapter directory (ours or peft's ``save_pretrained``) into an :class:`Adapter`."""
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    if not is_adapter_dir(step_dir):
        raise FileNotFoundError(f"lora: {step_dir} is not a PEFT adapter directory (needs {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE})")
    config = json.loads((step_dir / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"lora: {step_dir / CONFIG_FILE} has peft_type {config.get('peft_type')!r}, expected 'LORA'")
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"lora: {step_dir / CONFIG_FILE}: use_rslora / rank_pattern / alpha_pattern are not supported")
    tensors = from_peft_state(load_file(str(step_dir / WEIGHTS_FILE), device=device), config)
    return Adapter(tensors, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                   dropout=float(config.get("lora_dropout", 0.0)), base_model=config.get("base_model_name_or_path"))
