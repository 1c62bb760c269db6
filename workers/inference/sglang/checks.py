"""Plan checks for inference.backend=sglang: refuse option combinations SGLang rejects or
silently rewrites, before a 28-node job waits in the queue to find out; and the per-step
command previews the sbatch script shows (:func:`sglang_steps`). The launcher reaches both
only through this backend's spec (spec.py: ``check`` and ``plan_steps``).

Each rule cites where SGLang 0.5.23 (or smg 1.13.0) decides it, so the message can say
why. Pure: no sglang import (the launcher runs on login nodes without it); the flag names
themselves are checked against SGLang's own parser in tests/unit/inference/test_sglang_parser.py.
"""
from __future__ import annotations

from workers.common.config import RunConfig
from workers.common.config.ranges import TEXT, Each, Pattern, between, ge, gt, limits, one_of
from workers.inference.sglang import router as router_argv
from workers.inference.sglang import server as sglang_server
from workers.inference.sglang.args import features, server_env
from workers.inference.sglang.config import RouterConfig, SGLangConfig, SGLangRoleConfig, SGLangServerLayout
from workers.inference.sglang.ports import ports_needed
from workers.inference.spec import BackendConfigError as PlanError  # the launcher shows it as its PlanError
from workers.inference.spec import BackendStep
from workers.weights.lora_steps import lora_mode, sglang_lora_modules

A2A_BACKENDS = ("none", "deepep")
DEEPEP_MODES = ("auto", "normal", "low_latency")
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")
"""--disaggregation-transfer-backend choices (arg_groups/choices.py DISAGG_TRANSFER_BACKEND_CHOICES)."""
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_STORAGE = ("file", "mooncake", "hf3fs", "nixl", "aibrix", "eic", "simm", "mori", "shm", "tensorcast",
                   "seaweedfs", "npu_memcache", "dynamic")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16")
ROUTER_POLICIES = ("random", "round_robin", "passthrough", "cache_aware", "power_of_two", "least_load", "manual",
                   "consistent_hashing", "prefix_hash")
"""smg 1.13.0 router_args.py COMMON_POLICY_CHOICES (prefill also accepts ``bucket``)."""
QUANTIZATIONS = ("awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
                 "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8", "w8a8_fp8",
                 "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors", "modelslim",
                 "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8", "unquant", "humming")
ATTENTION_BACKENDS = ("triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "fa3", "fa4",
                      "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla", "tokenspeed_mla",
                      "trtllm_mha", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer", "aiter", "wave", "intel_amx",
                      "ascend", "intel_xpu")
MOE_RUNNER_BACKENDS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
                       "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
                       "flashinfer_megamoe", "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin",
                       "lora_cutedsl", "lora_triton", "lora_marlin", "hpc_ops", "megamoe", "intel_xpu")
FP8_GEMM_BACKENDS = ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_deepgemm",
                     "flashinfer_cutedsl", "cutlass", "triton", "aiter")
"""sglang/srt/arg_groups/choices.py QUANTIZATION_CHOICES, ATTENTION_BACKEND_CHOICES, MOE_RUNNER_BACKEND_CHOICES,
FP8_GEMM_RUNNER_BACKEND_CHOICES (tests/unit/common/test_config_ranges.py compares them when sglang is installed)."""
SERVER_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ROUTER_LOG_LEVELS = ("debug", "info", "warn", "error")

limits(SGLangRoleConfig, moe_a2a_backend=one_of(*A2A_BACKENDS), deepep_mode=one_of(*DEEPEP_MODES),
       ep_num_redundant_experts=ge(0), eplb_rebalance_num_iterations=gt(0), max_running_requests=gt(0),
       chunked_prefill_size=gt(0, also=(-1,)), cuda_graph_max_bs=gt(0), hicache_ratio=gt(0), hicache_size_gb=ge(0),
       hicache_write_policy=one_of(*HICACHE_WRITE_POLICIES), hicache_storage_backend=one_of(*HICACHE_STORAGE),
       hicache_storage_dir=TEXT, extra_args=Each(TEXT))
limits(RouterConfig, policy=one_of(*ROUTER_POLICIES), prefill_policy=one_of(*ROUTER_POLICIES, "bucket"),
       decode_policy=one_of(*ROUTER_POLICIES), routing_key_header=Pattern(r"[A-Za-z0-9!#$%&'*+.^_`|~-]*", "an HTTP header name"),
       request_timeout_s=gt(0), worker_startup_timeout_s=gt(0), health_check_interval_s=gt(0),
       log_level=one_of(*ROUTER_LOG_LEVELS), extra_args=Each(TEXT))
limits(SGLangConfig, model_path=TEXT, quantization=one_of(*QUANTIZATIONS), kv_cache_dtype=one_of(*KV_CACHE_DTYPES),
       fp8_gemm_backend=one_of(*FP8_GEMM_BACKENDS), moe_runner_backend=one_of(*MOE_RUNNER_BACKENDS),
       attention_backend=one_of(*ATTENTION_BACKENDS), mem_fraction_static=between(0, 1, lo_open=True, hi_open=True),
       context_length=gt(0), page_size=gt(0), disaggregation_transfer_backend=one_of(*TRANSFER_BACKENDS),
       disaggregation_ib_device=TEXT, watchdog_timeout_s=gt(0), log_level=one_of(*SERVER_LOG_LEVELS),
       extra_args=Each(TEXT), env=Each(TEXT))


def _choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise PlanError(f"{key}={value!r} is not supported; choose one of {list(choices)}")


def server_roles(cfg: RunConfig) -> list[tuple[str, SGLangServerLayout, str]]:
    i = cfg.inference
    if i.num_prefill_replicas or i.num_decode_replicas:
        return [("prefill", i.prefill, "inference.prefill"), ("decode", i.decode, "inference.decode")]
    return [("inference", i.worker, "inference.worker")]


def check_role(cfg: RunConfig, role: str, lay: SGLangServerLayout, key: str) -> None:
    r, k = lay.sglang, f"{key}.sglang"
    _choice(f"{k}.moe_a2a_backend", r.moe_a2a_backend, A2A_BACKENDS)
    _choice(f"{k}.deepep_mode", r.deepep_mode, DEEPEP_MODES)
    if r.moe_a2a_backend == "deepep":
        if lay.ep != lay.tp:  # arg_groups/overrides.py _a2a_ep_size
            raise PlanError(f"{key}.ep({lay.ep}) must equal {key}.tp({lay.tp}) with {k}.moe_a2a_backend=deepep: "
                            f"SGLang sets --ep-size to --tp-size for DeepEP, so the plan's expert split would be wrong")
        if r.deepep_mode == "normal" and role != "prefill" and not r.disable_cuda_graph:
            # arg_groups/moe_hook.py: "Cuda graph is disabled because deepep_mode=`normal`"
            raise PlanError(f"{k}.deepep_mode=normal on a server that decodes ({role}): SGLang then disables CUDA "
                            f"graphs, the main decode speed-up; use low_latency (or auto) for decode, normal for prefill")
    elif r.deepep_mode != "auto":
        raise PlanError(f"{k}.deepep_mode={r.deepep_mode!r} needs {k}.moe_a2a_backend=deepep (it is "
                        f"{r.moe_a2a_backend!r})")
    if (r.enable_eplb or r.ep_num_redundant_experts) and lay.ep <= 1:  # arg_groups/parallel_hook.py
        raise PlanError(f"{k}.enable_eplb / ep_num_redundant_experts need {key}.ep > 1 (it is {lay.ep}): "
                        f"EPLB moves experts between expert-parallel ranks")
    if r.ep_num_redundant_experts < 0:
        raise PlanError(f"{k}.ep_num_redundant_experts must be >= 0, got {r.ep_num_redundant_experts}")
    if r.enable_dp_lm_head and lay.dp_attention <= 1:
        raise PlanError(f"{k}.enable_dp_lm_head needs {key}.dp_attention > 1 (it is {lay.dp_attention}): the LM "
                        f"head is split inside each attention-DP group")
    if lay.dp_attention > 1 and lay.num_replicas_per_node > 1:
        raise PlanError(f"{key}: dp_attention({lay.dp_attention}) with num_replicas_per_node("
                        f"{lay.num_replicas_per_node}) > 1: SGLang derives 6 ZMQ ports above each replica's "
                        f"dist-init port, and replicas sharing a node would collide; give each replica its own node")
    check_hicache(r, k)
    if r.decode_radix_cache:
        if role != "decode":
            raise PlanError(f"{k}.decode_radix_cache applies to decode servers of prefill/decode disaggregation only "
                            f"(this is {role}; other servers keep their radix cache anyway)")
        if cfg.inference.sglang.disaggregation_transfer_backend == "fake":  # arg_groups/pd_disaggregation_hook.py
            raise PlanError(f"{k}.decode_radix_cache is incompatible with inference.sglang."
                            f"disaggregation_transfer_backend=fake (SGLang refuses it)")
    for name in ("max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs"):
        v = getattr(r, name)
        if v is not None and v <= 0 and not (name == "chunked_prefill_size" and v == -1):
            raise PlanError(f"{k}.{name} must be > 0, got {v}")


def check_hicache(r, k: str) -> None:
    """Hierarchical KV cache: GPU -> host memory -> optional storage tier (arg_groups/hicache_hook.py)."""
    if r.hicache_write_policy is not None:
        _choice(f"{k}.hicache_write_policy", r.hicache_write_policy, HICACHE_WRITE_POLICIES)
    if r.hicache_storage_backend is not None:
        _choice(f"{k}.hicache_storage_backend", r.hicache_storage_backend, HICACHE_STORAGE)
    if not r.enable_hierarchical_cache:
        set_ = [n for n in ("hicache_ratio", "hicache_storage_backend", "hicache_write_policy", "hicache_storage_dir")
                if getattr(r, n) is not None] + (["hicache_size_gb"] if r.hicache_size_gb else [])
        if set_:
            raise PlanError(f"{k}: {', '.join(set_)} set but {k}.enable_hierarchical_cache is false; the storage "
                            f"tier and host pool exist only with HiCache on")
        return
    if r.hicache_ratio is not None and r.hicache_size_gb:
        raise PlanError(f"{k}: set hicache_ratio({r.hicache_ratio}) or hicache_size_gb({r.hicache_size_gb}), not "
                        f"both (SGLang's --hicache-size overrides --hicache-ratio)")
    if r.hicache_ratio is not None and r.hicache_ratio <= 0:
        raise PlanError(f"{k}.hicache_ratio must be > 0, got {r.hicache_ratio}")
    if r.hicache_storage_backend == "file" and not r.hicache_storage_dir:
        raise PlanError(f"{k}.hicache_storage_backend=file needs {k}.hicache_storage_dir (e.g. node-local NVMe)")
    if r.hicache_storage_dir and r.hicache_storage_backend != "file":
        raise PlanError(f"{k}.hicache_storage_dir is used by the file backend only (backend is "
                        f"{r.hicache_storage_backend!r})")


def check_sglang(cfg: RunConfig) -> None:
    """Every SGLang rule: this backend's ``check`` (build_plan calls it when inference.backend=sglang)."""
    i, s = cfg.inference, cfg.inference.sglang
    if not s.model_path:
        raise PlanError("inference.sglang.model_path is empty: SGLang servers load the initial checkpoint from it "
                        "(a shared-filesystem path, e.g. ${cluster.shared_root}/models/<name>)")
    _choice("inference.sglang.kv_cache_dtype", s.kv_cache_dtype, KV_CACHE_DTYPES)
    _choice("inference.sglang.disaggregation_transfer_backend", s.disaggregation_transfer_backend, TRANSFER_BACKENDS)
    if s.mem_fraction_static is not None and not 0 < s.mem_fraction_static < 1:
        raise PlanError(f"inference.sglang.mem_fraction_static must be in (0, 1), got {s.mem_fraction_static}")
    if s.watchdog_timeout_s <= 0:
        raise PlanError(f"inference.sglang.watchdog_timeout_s must be > 0, got {s.watchdog_timeout_s}")
    r = s.router
    _choice("inference.sglang.router.policy", r.policy, ROUTER_POLICIES)
    _choice("inference.sglang.router.prefill_policy", r.prefill_policy, ROUTER_POLICIES + ("bucket",))
    _choice("inference.sglang.router.decode_policy", r.decode_policy, ROUTER_POLICIES)
    if not r.routing_key_header:
        raise PlanError("inference.sglang.router.routing_key_header is empty: sticky routing of an episode's turns "
                        "needs a header name (smg reads x-smg-routing-key)")
    mode = lora_mode(cfg)  # LoRA mode: every trainer.lora target must be one SGLang serves
    if mode is not None:
        try:
            sglang_lora_modules(mode)
        except ValueError as e:
            raise PlanError(str(e)) from None
    roles = server_roles(cfg)
    for role, lay, key in roles:
        check_role(cfg, role, lay, key)
    pd = roles[0][0] == "prefill"  # with routed experts the orchestrator pairs prefill/decode itself (pd_client.py)
    num_servers = i.num_prefill_replicas + i.num_decode_replicas if pd else i.num_workers
    need = ports_needed(num_servers)
    if cfg.cluster.port_span < need:
        raise PlanError(f"cluster.port_span({cfg.cluster.port_span}) < {need} ports this SGLang job needs "
                        f"(topology's server ports, SGLang's derived ZMQ ports and a bootstrap + engine-info port "
                        f"per server for {num_servers} servers; workers/inference/sglang/ports.py)")


def sglang_steps(cfg: RunConfig) -> tuple[BackendStep, ...]:
    """One entry per server role plus the router, in het-group order (env: NVSHMEM for DeepEP,
    CUDA graph / HiCache settings; features: the Slurm guide's table and the plan summary)."""
    out = [BackendStep(role=role, argv=tuple(sglang_server.preview(cfg, role)), env=tuple(server_env(cfg, role).items()),
                      features=tuple(features(cfg, role))) for role, _, _ in server_roles(cfg)]
    pd = out[0].role == "prefill"
    out.append(BackendStep(role="router", argv=tuple(router_argv.preview(cfg)), env=(),
                          features=("smg PD" if pd else "smg", cfg.inference.sglang.router.prefill_policy if pd
                                    else cfg.inference.sglang.router.policy)))
    return tuple(out)
