"""The SGLang backend's schema (``inference=sglang``): job-wide options, per server role, and the router.

Why a file of its own: SGLang has hundreds of flags; we model the ones an RL deployment of
a large MoE needs (prefill/decode disaggregation, wide expert parallelism with DeepEP,
FP8 with DeepGEMM, hierarchical KV cache, routed-expert return, CUDA graphs) as typed,
documented fields, and keep ``extra_args`` as the escape hatch. Every field maps to a
flag of the SGLang version pinned in setup.cfg's ``[sglang]`` extra (0.5.23); the mapping
is workers/inference/sglang/args.py and tests/unit/inference/test_sglang_parser.py parses the result
with SGLang's own argument parser. The router is smg (the SGLang Model Gateway, formerly
``sglang-router``), pinned in the same extra.

Where they live: ``inference.sglang`` (:class:`SGLangConfig`) is shared by every server;
``inference.worker.sglang`` / ``inference.prefill.sglang`` / ``inference.decode.sglang``
(:class:`SGLangRoleConfig`) differ per role, e.g. DeepEP ``normal`` for prefill and
``low_latency`` for decode. Cross-option conflicts are refused by the plan
(workers/inference/sglang/checks.py), never silently fixed here. :class:`SGLangInferenceConfig`
is the whole ``inference`` section with these options.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from workers.common.config.inference import InferenceConfig, ServerLayout


@dataclasses.dataclass(kw_only=True)
class SGLangRoleConfig:
    """Options of one server role (unified workers, prefill or decode) in SGLang's terms."""

    moe_a2a_backend: str = "none"
    """MoE all-to-all (--moe-a2a-backend): ``none`` (TP-style MoE) or ``deepep`` for wide expert
    parallelism; with DeepEP SGLang sets --ep-size to --tp-size, so the plan needs ep == tp."""
    deepep_mode: str = "auto"
    """DeepEP kernels (--deepep-mode): ``normal`` (throughput, prefill), ``low_latency`` (decode,
    CUDA-graph friendly) or ``auto`` (low_latency for decode batches, normal for prefill)."""
    enable_eplb: bool = False
    """Expert-parallel load balancer (--enable-eplb): moves hot experts between GPUs; needs ep > 1."""
    ep_num_redundant_experts: int = 0
    """Extra expert replicas per layer that EPLB may place on busy GPUs (--ep-num-redundant-experts)."""
    eplb_rebalance_num_iterations: Optional[int] = None
    """Forward passes between EPLB rebalances (--eplb-rebalance-num-iterations); None: SGLang's 1000."""
    enable_dp_lm_head: bool = False
    """Vocabulary-parallel LM head inside each attention-DP group (--enable-dp-lm-head); needs dp_attention > 1."""
    max_running_requests: Optional[int] = None
    """Most requests decoding at once per server (--max-running-requests); None: SGLang sizes it."""
    chunked_prefill_size: Optional[int] = None
    """Tokens per prefill chunk (--chunked-prefill-size); None: SGLang's default for the GPU."""
    cuda_graph_max_bs: Optional[int] = None
    """Largest decode batch captured as a CUDA graph (--cuda-graph-max-bs-decode); None: SGLang's default."""
    disable_cuda_graph: bool = False
    """Run eagerly (--cuda-graph-backend-decode/prefill=disabled): for debugging, costs decode speed."""
    enable_hierarchical_cache: bool = False
    """HiCache (--enable-hierarchical-cache): KV pages evicted from GPU go to pinned host memory and are
    fetched back on a prefix hit, so long multi-turn prefixes survive weight updates and load."""
    hicache_ratio: Optional[float] = None
    """Host KV pool size as a multiple of the GPU pool (--hicache-ratio); None: SGLang's 2.0."""
    hicache_size_gb: int = 0
    """Host KV pool in GB per rank (--hicache-size); overrides hicache_ratio (set one of them)."""
    hicache_write_policy: Optional[str] = None
    """write_through | write_back | write_through_selective (--hicache-write-policy); None: SGLang's."""
    hicache_storage_backend: Optional[str] = None
    """Third tier under host memory (--hicache-storage-backend): ``file`` (a directory, e.g. node-local
    NVMe), ``mooncake``, ``hf3fs``, ``nixl``, ...; None: GPU + host only."""
    hicache_storage_dir: Optional[str] = None
    """Directory of the ``file`` storage backend (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)."""
    decode_radix_cache: bool = False
    """Decode servers keep a radix prefix cache (--disaggregation-decode-enable-radix-cache, experimental
    in SGLang): the next turn of an episode transfers only its new KV from prefill."""
    extra_args: list[str] = field(default_factory=list)
    """More ``--flag value`` items appended verbatim (still checked by the SGLang parser test)."""


@dataclasses.dataclass(kw_only=True)
class RouterConfig:
    """smg (SGLang Model Gateway, ``python -m smg.launch_router``) in front of the servers."""

    policy: str = "consistent_hashing"
    """Policy of unified workers (--policy); ``consistent_hashing`` keeps one routing key on one worker."""
    prefill_policy: str = "consistent_hashing"
    """PD mode: which prefill server takes a request (--prefill-policy). Hashing the episode's routing
    key sends every turn of an episode to the server that holds its prefix in cache. With
    orchestrator.return_routed_experts the orchestrator pairs prefill and decode itself (hashing the
    same key; workers/inference/sglang/pd_client.py), so smg's policies apply to nothing then."""
    decode_policy: str = "power_of_two"
    """PD mode: which decode server takes a request (--decode-policy); load-based by default."""
    routing_key_header: str = "x-smg-routing-key"
    """Header the orchestrator puts the episode's routing key in (--routing-key-headers)."""
    request_timeout_s: int = 1800
    """Router-side deadline of one request (--request-timeout-secs); long agent turns need a lot."""
    worker_startup_timeout_s: int = 1800
    """How long the router waits for servers at start (--worker-startup-timeout-secs)."""
    health_check_interval_s: int = 30
    """Seconds between the router's probes of each server (--health-check-interval-secs)."""
    log_level: str = "info"
    """debug | info | warn | error (--log-level)."""
    extra_args: list[str] = field(default_factory=list)
    """More router flags, appended verbatim (checked by smg's parser in the tests)."""


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """Options shared by every SGLang server of the job (``inference.sglang``)."""

    model_path: str = ""
    """Initial checkpoint (HF format) on the shared filesystem, or a hub id the nodes can reach;
    required with inference.backend=sglang. Later weights come from run_dir/weights/step_N."""
    trust_remote_code: bool = True
    """--trust-remote-code (Kimi-K2 and Nemotron ship custom model code)."""
    quantization: Optional[str] = None
    """--quantization: None (the checkpoint's own: bf16, or fp8 where the checkpoint declares it),
    ``fp8`` (quantize bf16 weights to FP8 at load), ``w8a8_fp8``, ..."""
    kv_cache_dtype: str = "auto"
    """--kv-cache-dtype: ``auto`` (the model dtype) or ``fp8_e4m3`` (half the KV memory)."""
    fp8_gemm_backend: str = "auto"
    """Dense FP8 GEMMs (--fp8-gemm-backend): ``deep_gemm`` for DeepGEMM's block-scaled kernels."""
    moe_runner_backend: str = "auto"
    """Expert GEMMs (--moe-runner-backend): ``deep_gemm`` for DeepGEMM grouped FP8 GEMMs (the DeepEP path)."""
    attention_backend: Optional[str] = None
    """--attention-backend (``fa3``, ``flashmla``, ``flashinfer``, ...); None: SGLang picks per model/GPU."""
    mem_fraction_static: Optional[float] = None
    """GPU memory share for weights + KV cache (--mem-fraction-static); None: SGLang's estimate."""
    context_length: Optional[int] = None
    """--context-length; None: the model's max_position_embeddings from its config.json."""
    page_size: Optional[int] = None
    """KV cache page size in tokens (--page-size); None: SGLang's default for the attention backend."""
    disaggregation_transfer_backend: str = "mooncake"
    """KV transfer prefill -> decode (--disaggregation-transfer-backend): mooncake | nixl | mori | ..."""
    disaggregation_ib_device: Optional[str] = None
    """InfiniBand devices for the KV transfer (--disaggregation-ib-device), e.g. ``mlx5_0,mlx5_1``."""
    watchdog_timeout_s: float = 600.0
    """A forward pass stuck longer than this kills the server (--watchdog-timeout) instead of hanging."""
    enable_metrics: bool = True
    """Prometheus metrics on the HTTP port (--enable-metrics)."""
    log_level: str = "info"
    """--log-level of the servers."""
    extra_args: list[str] = field(default_factory=list)
    """More ``--flag value`` items for every server (after the role's own)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the SGLang steps on top of the defaults (NCCL, NVSHMEM for DeepEP, CUDA graph
    options; see workers/inference/sglang/args.py: server_env)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router in front of the servers."""


@dataclasses.dataclass(kw_only=True)
class SGLangServerLayout(ServerLayout):
    """A server role's layout plus its SGLang options (``inference.worker`` / ``prefill`` / ``decode``)."""

    sglang: SGLangRoleConfig = field(default_factory=SGLangRoleConfig)
    """SGLang options of this role (DeepEP mode, EPLB, HiCache, CUDA graphs)."""


@dataclasses.dataclass(kw_only=True)
class SGLangInferenceConfig(InferenceConfig):
    """The ``inference`` section with SGLang servers (GPU clusters) behind smg."""

    backend: str = "sglang"
    """``sglang``: this schema's backend."""
    worker: SGLangServerLayout = field(default_factory=SGLangServerLayout)
    """Layout and SGLang options of each of the ``num_workers`` unified (prefill + decode) servers."""
    prefill: SGLangServerLayout = field(default_factory=SGLangServerLayout)
    """Layout and SGLang options of each prefill server."""
    decode: SGLangServerLayout = field(default_factory=SGLangServerLayout)
    """Layout and SGLang options of each decode server."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options shared by every SGLang server and the router."""
