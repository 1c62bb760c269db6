"""Config -> the exact ``python -m sglang.launch_server`` command line of one server task.

Pure functions of the resolved config and a :class:`Placement` (where this task sits: its
role, replica, node rank, addresses and ports, all derived from workers/common/topology.py
by server.py). No torch and no sglang import: the launcher renders the
same argv into the sbatch script's comments, and tests/unit/inference/test_sglang_parser.py feeds
every generated argv to SGLang 0.5.23's own argument parser (ServerArgs.add_cli_args),
so a flag name that does not exist in the pinned version fails CI.

Flags are emitted in a fixed order, grouped by concern (model, placement, disaggregation,
MoE, memory and cache, RL), each group only when its feature is on, so a reviewer can read
off which SGLang features a preset turns on (docs/guide/slurm_cluster.md, "SGLang features per preset").
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from workers.common.config import RunConfig
from workers.common.dtypes import check_name
from workers.inference.sglang.config import SGLangConfig, SGLangInferenceConfig, SGLangRoleConfig, SGLangServerLayout

SGLANG_MODULE = "sglang.launch_server"
DISAGGREGATION_MODE = {"inference": None, "prefill": "prefill", "decode": "decode"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one SGLang server task runs (derived from the Topology; see sglang.placement)."""

    role: str
    """inference | prefill | decode."""
    replica: int
    """Replica index inside the role."""
    node_rank: int
    """This task's node inside its replica (--node-rank); 0 is the head that serves HTTP."""
    num_nodes: int
    """Nodes of the replica (--nnodes)."""
    host: str
    """Address the HTTP server binds to (this node's address)."""
    port: int
    """HTTP port of the replica (the head's)."""
    dist_init_addr: Optional[str]
    """``head:port`` rendezvous of a multi-node or DP-attention replica (--dist-init-addr)."""
    bootstrap_port: int
    """Prefill servers: port of the KV-transfer bootstrap server (--disaggregation-bootstrap-port)."""
    engine_info_port: int
    """--engine-info-bootstrap-port: its default (6789) collides when servers share a node."""


def role_layout(inf: SGLangInferenceConfig, role: str) -> SGLangServerLayout:
    return {"inference": inf.worker, "prefill": inf.prefill, "decode": inf.decode}[role]


def flag(name: str, value: object = None) -> list[str]:
    """``["--name"]`` for a switch (value None), else ``["--name", "value"]`` (argv items, unquoted)."""
    return [f"--{name}"] if value is None else [f"--{name}", str(value)]


def opt(name: str, value: object) -> list[str]:
    """The flag only when the option is set (not None / not False)."""
    if value is None or value is False:
        return []
    return flag(name) if value is True else flag(name, value)


def model_args(s: SGLangConfig, inf: SGLangInferenceConfig, served_name: str) -> list[str]:
    """Model, dtype and quantization. Token ids in and out: the orchestrator tokenizes itself."""
    out = flag("model-path", s.model_path) + flag("served-model-name", served_name)
    out += flag("dtype", check_name("inference.dtype", inf.dtype)) + flag("skip-tokenizer-init")
    out += opt("trust-remote-code", s.trust_remote_code)
    out += opt("quantization", s.quantization)
    if s.kv_cache_dtype != "auto":
        out += flag("kv-cache-dtype", s.kv_cache_dtype)
    if s.fp8_gemm_backend != "auto":
        out += flag("fp8-gemm-backend", s.fp8_gemm_backend)
    out += opt("attention-backend", s.attention_backend)
    out += opt("context-length", s.context_length)
    return out


def placement_args(lay: SGLangServerLayout, p: Placement) -> list[str]:
    """HTTP address, parallel sizes, and the multi-node rendezvous."""
    out = flag("host", p.host) + flag("port", p.port)
    out += flag("tp-size", lay.tp)
    if lay.ep > 1:
        out += flag("ep-size", lay.ep)
    if lay.dp_attention > 1:
        out += flag("attn-dp-size", lay.dp_attention)
    if p.num_nodes > 1:
        out += flag("nnodes", p.num_nodes) + flag("node-rank", p.node_rank)
    if p.dist_init_addr is not None:
        out += flag("dist-init-addr", p.dist_init_addr)
    out += flag("engine-info-bootstrap-port", p.engine_info_port)
    return out


def disaggregation_args(s: SGLangConfig, r: SGLangRoleConfig, p: Placement) -> list[str]:
    mode = DISAGGREGATION_MODE[p.role]
    if mode is None:
        return []
    out = flag("disaggregation-mode", mode) + flag("disaggregation-transfer-backend", s.disaggregation_transfer_backend)
    out += opt("disaggregation-ib-device", s.disaggregation_ib_device)
    if mode == "prefill":
        out += flag("disaggregation-bootstrap-port", p.bootstrap_port)
    elif r.decode_radix_cache:
        out += flag("disaggregation-decode-enable-radix-cache")
    return out


def moe_args(s: SGLangConfig, r: SGLangRoleConfig, lay: SGLangServerLayout) -> list[str]:
    """Expert parallelism: DeepEP all-to-all, its mode, DeepGEMM experts, EPLB."""
    out: list[str] = []
    if r.moe_a2a_backend != "none":
        out += flag("moe-a2a-backend", r.moe_a2a_backend)
        if r.deepep_mode != "auto":
            out += flag("deepep-mode", r.deepep_mode)
    if s.moe_runner_backend != "auto":
        out += flag("moe-runner-backend", s.moe_runner_backend)
    if r.enable_eplb:
        out += flag("enable-eplb")
        out += opt("eplb-rebalance-num-iterations", r.eplb_rebalance_num_iterations)
    if r.ep_num_redundant_experts:
        out += flag("ep-num-redundant-experts", r.ep_num_redundant_experts)
    if r.enable_dp_lm_head:
        out += flag("enable-dp-lm-head")
    return out


def memory_args(s: SGLangConfig, r: SGLangRoleConfig, inf: SGLangInferenceConfig) -> list[str]:
    """Memory pool, batch limits, CUDA graphs, hierarchical KV cache."""
    out = opt("mem-fraction-static", s.mem_fraction_static) + opt("page-size", s.page_size)
    out += flag("max-running-requests", r.max_running_requests or inf.max_batch_size)
    out += opt("chunked-prefill-size", r.chunked_prefill_size)
    if r.disable_cuda_graph:
        out += flag("cuda-graph-backend-decode", "disabled") + flag("cuda-graph-backend-prefill", "disabled")
    else:
        out += opt("cuda-graph-max-bs-decode", r.cuda_graph_max_bs)
    if r.enable_hierarchical_cache:
        out += flag("enable-hierarchical-cache")
        out += opt("hicache-ratio", r.hicache_ratio)
        out += opt("hicache-size", r.hicache_size_gb or None)
        out += opt("hicache-write-policy", r.hicache_write_policy)
        out += opt("hicache-storage-backend", r.hicache_storage_backend)
    return out


def rl_args(s: SGLangConfig, return_routed_experts: bool) -> list[str]:
    """What the RL loop needs: routed experts for Router Replay, metrics, a watchdog.

    Logprobs need no server flag (``return_logprob`` is per request); the admin endpoints
    (pause/continue, update_weights_from_disk / _distributed) exist on every SGLang server
    and are guarded by --api-key, the run's admin token (run_dir/admin_token), which is never
    on this argv: keyed.py adds it in memory (a command line is visible to every user).
    """
    out = opt("enable-return-routed-experts", return_routed_experts)
    out += flag("weight-version", 0)  # an integer from the start: the client reads versions as ints
    out += opt("enable-metrics", s.enable_metrics)
    out += flag("watchdog-timeout", f"{s.watchdog_timeout_s:g}") + flag("log-level", s.log_level)
    return out


def weight_loader_args(cfg: RunConfig) -> list[str]:
    """Sparse weight updates (weights.delta): the loader that applies a patch inside the server, named by
    import path (SGLang's --custom-weight-loader; /update_weights_from_tensor calls it when its
    load_format names it: workers/weights/sglang/patch_loader.py). Over ``broadcast`` it receives
    the patch on SGLang's group; over ``filesystem`` each rank pulls its share of the patch step from disk."""
    if not getattr(cfg.weights, "delta", False) or cfg.weights.transport not in ("broadcast", "filesystem"):
        return []
    from workers.weights.sglang.wire import DELTA_LOADER

    return flag("custom-weight-loader", DELTA_LOADER)


def lora_args(cfg: RunConfig) -> list[str]:
    """LoRA mode (trainer.lora.rank > 0): servers serve the base plus adapters loaded by name at run time
    (/load_lora_adapter, workers/weights/lora_coordinator.py): the largest rank, the modules, and room for
    two adapters per batch (the one being replaced finishes its requests beside the new one) plus the base."""
    from workers.weights.lora_steps import lora_mode, sglang_lora_modules

    mode = lora_mode(cfg)
    if mode is None:
        return []
    return (flag("enable-lora") + opt("max-lora-rank", mode.rank)
            + ["--lora-target-modules", *sglang_lora_modules(mode)]
            + opt("max-loras-per-batch", 2 * len(mode.adapters) + 1))


def server_argv(cfg: RunConfig, p: Placement, *, python: str = "python") -> list[str]:
    """The full command line of one SGLang server task (argv, not shell-quoted), without the key."""
    inf, s = cfg.inference, cfg.inference.sglang
    lay = role_layout(inf, p.role)
    r = lay.sglang
    argv = [python, "-m", SGLANG_MODULE]
    argv += model_args(s, inf, served_name=cfg.model.name)
    argv += placement_args(lay, p)
    argv += disaggregation_args(s, r, p)
    argv += moe_args(s, r, lay)
    argv += memory_args(s, r, inf)
    argv += rl_args(s, cfg.orchestrator.return_routed_experts)
    argv += weight_loader_args(cfg)
    argv += lora_args(cfg)
    return argv + list(r.extra_args) + list(s.extra_args)


def server_env(cfg: RunConfig, role: str) -> dict[str, str]:
    """Environment of a server step: what DeepEP, CUDA graphs and HiCache need.

    Why each: DeepEP's internode kernels run on NVSHMEM over InfiniBand with GPU-initiated
    transfers (IBGDA). In low-latency mode DeepEP sizes its buffers for
    SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK tokens (128 by default), which must
    cover the largest captured decode CUDA graph batch, so it follows cuda_graph_max_bs.
    NCCL_CUMEM_ENABLE=1 keeps collectives captured in CUDA graphs valid (SGLang sets it for
    DeepEP v2 itself). The file tier of HiCache reads its directory from the environment.
    Site NCCL/IB settings come from cluster.env; ``inference.sglang.env`` overrides all.
    """
    inf = cfg.inference
    r = role_layout(inf, role).sglang
    env = {"NCCL_CUMEM_ENABLE": "1", "SGLANG_SET_CPU_AFFINITY": "1"}
    if r.moe_a2a_backend.startswith("deepep"):
        env["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
        if r.deepep_mode != "normal":
            env["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(max(128, r.cuda_graph_max_bs or 0))
    if r.hicache_storage_backend == "file" and r.hicache_storage_dir:
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = r.hicache_storage_dir
    env.update(inf.sglang.env)
    return dict(sorted(env.items()))


def features(cfg: RunConfig, role: str) -> list[str]:
    """Short names of the SGLang features a role turns on (the Slurm guide's table, plan summary)."""
    inf = cfg.inference
    lay, s = role_layout(inf, role), inf.sglang
    r = lay.sglang
    out = []
    if role != "inference":
        out.append(f"PD {role} ({s.disaggregation_transfer_backend})")
    if lay.num_nodes_per_replica > 1:
        out.append(f"multi-node x{lay.num_nodes_per_replica}")
    out.append(f"tp{lay.tp}" + (f" ep{lay.ep}" if lay.ep > 1 else "") +
               (f" dp-attn{lay.dp_attention}" if lay.dp_attention > 1 else ""))
    if r.moe_a2a_backend != "none":
        out.append(f"{r.moe_a2a_backend} {r.deepep_mode}")
    if r.enable_eplb:
        out.append("EPLB" + (f" +{r.ep_num_redundant_experts} redundant" if r.ep_num_redundant_experts else ""))
    if s.quantization or "deep_gemm" in (s.fp8_gemm_backend, s.moe_runner_backend):
        out.append(f"FP8 {s.quantization or 'checkpoint'}"
                   + (" + DeepGEMM" if "deep_gemm" in (s.fp8_gemm_backend, s.moe_runner_backend) else ""))
    if s.kv_cache_dtype != "auto":
        out.append(f"KV {s.kv_cache_dtype}")
    if r.enable_hierarchical_cache:
        out.append("HiCache host" + (f" + {r.hicache_storage_backend}" if r.hicache_storage_backend else ""))
    if r.decode_radix_cache and role == "decode":
        out.append("decode radix cache")
    if cfg.orchestrator.return_routed_experts:
        out.append("routed experts")
    if r.disable_cuda_graph or (r.moe_a2a_backend == "deepep" and r.deepep_mode == "normal"):
        out.append("CUDA graphs off")  # SGLang turns them off for DeepEP normal (moe_hook.py)
    else:
        out.append("CUDA graphs" + (f" bs<={r.cuda_graph_max_bs}" if r.cuda_graph_max_bs else ""))
    return out
