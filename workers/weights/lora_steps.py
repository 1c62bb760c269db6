"""LoRA mode's published steps as every side sees them (torch-free: the orchestrator and the launcher read it).

In LoRA mode (``trainer.lora.rank > 0``) the base never changes, so a weight update is the adapter:

    weights/step_000000/   the frozen base, a full step as today (whatever ``weights.transport``: workers
                           boot from it; retention never deletes it)
    weights/step_N/        N >= 1: the adapter, a PEFT directory (workers/weights/lora_format.py) plus
                           ``slurmrl_adapter.json`` {format, step, base_step, digest, bytes} and STABLE,
                           written last (workers/weights/lora_publisher.py)

Every transport delivers the adapter step, not the merged model: adapters are small (the plan prints
their bytes per update), so the broadcast group is not used for them; embedded workers load it with
``/update_weights_from_disk`` (it is recognised as an adapter by its files), SGLang servers with their own
``/load_lora_adapter`` (workers/weights/lora_coordinator.py).

Several adapters on one base (``trainer.lora.adapters=[a, b]``): each step N >= 1 holds one PEFT
directory per adapter, ``weights/step_N/adapters/<name>/`` (each loads with
``peft.PeftModel.from_pretrained(base, that_dir)``), and one side file at the step's top whose
``digest`` is :func:`combined_digest` of the adapters' own digests (listed under ``adapters``): an
engine confirms the step only when it serves every adapter of it.

``digest`` is the confirmation checksum: ``state_digest`` (workers/weights/digest.py) of the xxh3 of
every tensor's bytes under its PEFT name, computed by the trainer over what it wrote. A worker answers
the same over what it read and copied into its buffers; the orchestrator samples from version N only
once every worker it samples from confirmed that digest (the verl #7495 bug: rollouts sampled the
initial policy for two months because the adapter never reached the engine). Without the side file
(a step written by another tool) :func:`file_digest` recomputes it from the safetensors file itself.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, Optional

SIDECAR = "slurmrl_adapter.json"
FORMAT = "slurmrl-lora/1"
BASE_STEP = 0
"""The version whose step holds the frozen base (the first publish)."""
WEIGHTS_FILE = "adapter_model.safetensors"  # lora_format's names (that module imports torch)
CONFIG_FILE = "adapter_config.json"
ADAPTERS_DIR = "adapters"
"""Several adapters: the subdirectory of a step holding one PEFT directory per adapter name."""


@dataclasses.dataclass(frozen=True)
class LoraMode:
    """What inference needs to know of ``trainer.lora`` (None from :func:`lora_mode`: full fine-tuning)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    """``nn.Linear`` leaf names (groups expanded: workers/common/config/lora.py), plus ``experts``."""
    adapters: tuple[str, ...] = ("default",)


def lora_mode(cfg: Any) -> Optional[LoraMode]:
    """The run's LoRA settings, None when ``trainer.lora.rank`` is 0 (or the config has no such section)."""
    lora = getattr(getattr(cfg, "trainer", None), "lora", None)
    rank = int(getattr(lora, "rank", 0) or 0)
    if rank <= 0:
        return None
    from workers.common.config.lora import EXPERTS, adapts_experts, linear_targets

    wanted = list(getattr(lora, "targets", None) or ())
    targets = tuple(sorted(linear_targets(wanted))) + ((EXPERTS,) if adapts_experts(wanted) else ())
    names = tuple(getattr(a, "name", a) for a in (getattr(lora, "adapters", None) or ())) or ("default",)
    return LoraMode(rank=rank, alpha=float(getattr(lora, "alpha", rank)), targets=targets, adapters=names)



def is_adapter_step(step_dir) -> bool:
    p = Path(step_dir)
    return ((p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()) or bool(adapter_dirs(p))


def adapter_dirs(step_dir) -> dict[str, Path]:
    """Several adapters: name -> its PEFT directory in ``step_dir/adapters/`` ({} for a one-adapter step)."""
    root = Path(step_dir) / ADAPTERS_DIR
    try:
        subs = sorted(root.iterdir())
    except OSError:
        return {}
    return {d.name: d for d in subs if (d / CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file()}


def combined_digest(digests: dict[str, Optional[str]]) -> Optional[str]:
    """One digest of a several-adapter step from each adapter's (None when any is missing)."""
    from workers.weights.digest import state_digest

    if not digests or any(d is None for d in digests.values()):
        return None
    return state_digest(digests)


def sidecar(step_dir) -> Optional[dict]:
    try:
        out = json.loads((Path(step_dir) / SIDECAR).read_text())
        return out if isinstance(out, dict) and out.get("format") == FORMAT else None
    except (OSError, ValueError):
        return None


def expected_digest(step_dir) -> Optional[str]:
    """The trainer's digest of adapter step ``step_dir`` (its side file, else the file's own bytes);
    None when it is not an adapter step or cannot be read."""
    side = sidecar(step_dir)
    if side is not None and isinstance(side.get("digest"), str):
        return side["digest"]
    several = adapter_dirs(step_dir)
    if several:
        return combined_digest({name: file_digest(d / WEIGHTS_FILE) for name, d in several.items()})
    return file_digest(Path(step_dir) / WEIGHTS_FILE)


def file_digest(path) -> Optional[str]:
    """``state_digest`` of the xxh3 of every tensor in a safetensors file, from its header and bytes
    (the same value workers/inference/embedded/lora.peft_digest gives for the loaded tensors)."""
    import xxhash

    from workers.weights.digest import state_digest

    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            base = 8 + n
            hashes = {}
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                lo, hi = meta["data_offsets"]
                f.seek(base + lo)
                hashes[name] = f"{xxhash.xxh3_64_intdigest(f.read(hi - lo)):016x}"
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return state_digest(hashes)


SGLANG_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj",
                  "gate_proj", "up_proj", "down_proj")
"""``trainer.lora`` targets SGLang 0.5.23 serves (its SUPPORTED_LORA_TARGET_MODULES, less fused names we never
publish); routed experts come as ``gate_up_proj`` / ``down_proj`` (peft's target_parameters layout)."""


def sglang_lora_modules(mode: LoraMode) -> list[str]:
    """``--lora-target-modules`` for SGLang servers; ValueError naming what SGLang cannot serve."""
    linear = [t for t in mode.targets if t != "experts"]
    out = [t for t in linear if t in SGLANG_TARGETS]
    missing = sorted(set(linear) - set(out) - {"in_proj", "out_proj", "fc1_latent_proj", "fc2_latent_proj"})
    extra = sorted(set(linear) & {"in_proj", "out_proj", "fc1_latent_proj", "fc2_latent_proj"})
    if missing or extra:
        raise ValueError(f"trainer.lora.targets: SGLang 0.5.23 serves no LoRA on {missing + extra} (Mamba-2 and "
                         f"latent-MoE projections); drop the 'mamba' / 'latent' targets or use inference=embedded")
    if "experts" in mode.targets:
        out += ["gate_up_proj", "down_proj"]
    return list(dict.fromkeys(out))
