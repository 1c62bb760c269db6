"""Every published-scale number the simulator uses, each with its source.

Why one module: the simulator's answers are only as good as these numbers, so they live
in one place, print as one table (``python -m tools.simulator ... --assumptions``),
and the sensitivity study perturbs them by name. Anchors are *published measurements*
(throughput of a named system on named hardware); the cost model in costs.py turns them
into per-GPU efficiencies and re-applies those to our model, dtype and layout, so that
changing GLM-5 for another preset or bf16 for fp8 changes the answer for a reason.

Numbers marked "assumption" have no single published source; they are our estimate and
are the first candidates for the sensitivity table.
"""
from __future__ import annotations

import dataclasses
from typing import Any


def fact(value: Any, unit: str, source: str) -> Any:
    """A dataclass field carrying its unit and source (printed by :func:`table`)."""
    return dataclasses.field(default=value, metadata={"unit": unit, "source": source})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One H200 SXM GPU and its node (HGX H200, 8 GPUs, one 400G NIC per GPU)."""

    bf16_tflops: float = fact(989.0, "TFLOP/s", "NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense (1,979 with "
                                                "sparsity); same tensor cores as H100 SXM. This machine's H200 measured "
                                                "778 TFLOP/s on a bf16 8192^3 matmul (docs/design.md, 'Platform facts')")
    fp8_tflops: float = fact(1979.0, "TFLOP/s", "NVIDIA H200 SXM datasheet: 1,979 TFLOPS FP8 dense")
    hbm_tb_s: float = fact(4.8, "TB/s", "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e (H100 SXM: 3.35 TB/s); this "
                                        "machine measured 4.27 TB/s device copy (docs/design.md, 'Platform facts')")
    nic_gb_s: float = fact(50.0, "GB/s per GPU", "InfiniBand NDR 400 Gb/s per GPU: one ConnectX-7 per GPU, 8 per "
                                                 "HGX node (server-parts.eu 'InfiniBand networking for H100/H200 "
                                                 "clusters'; imbue's 4,088-H100 cluster: 400 Gbps CX7 per GPU)")
    a2a_efficiency: float = fact(0.915, "fraction", "DeepEP README (V2, SM90 + CX7, 8K tokens, hidden 7168, top-8): "
                                                    "61 GB/s logical at EP 8x4, 90 GB/s at EP 8x2; logical = NIC x eff / "
                                                    "(1 - 1/nodes) fits both with eff 0.915")
    nvlink_a2a_gb_s: float = fact(150.0, "GB/s per GPU", "DeepEP V1 intranode (legacy docs): ~150 GB/s NVLink "
                                                         "dispatch/combine on H800 (used when an EP group fits one node)")
    bulk_efficiency: float = fact(0.8, "fraction", "assumption: NCCL broadcast/allgather bus bandwidth ~80% of "
                                                   "NIC line rate on NDR (nccl-tests on HGX H100 typically 350-390 "
                                                   "GB/s per node of 400)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving:
    """Large-scale EP serving anchors (DeepSeek-V3 with SGLang) and the terms derived from them."""

    anchor_decode_tok_s_node: float = fact(22_300.0, "tok/s/node", "LMSYS 2025-05-05 'Deploying DeepSeek with PD "
                                           "disaggregation and large-scale EP on 96 H100': 22.3k output tok/s per "
                                           "node, 2000-token inputs, DeepSeek-V3 FP8")
    anchor_decode_itl_s: float = fact(0.092, "s", "same blog: ITL ~100 ms at that throughput (limitations section); "
                                                  "256 running requests/GPU x 8 / 22.3k tok/s = 92 ms")
    anchor_decode_batch_per_gpu: int = fact(256, "seqs", "same blog: decode batch 256 per GPU (DeepEP low-latency, "
                                                         "CUDA graphs), 9 decode nodes = EP72 with 32 redundant experts")
    anchor_decode_ctx: int = fact(2_000, "tokens", "same blog: 2000-token input sequences")
    anchor_prefill_tok_s_node: float = fact(52_300.0, "tok/s/node", "same blog: 52.3k input tok/s per node "
                                                                     "(4 prefill nodes, EP32, 2000-token inputs)")
    decode_step_overhead_s: float = fact(0.010, "s per step", "assumption: scheduler + kernel-launch floor of one "
                                         "decode iteration with CUDA graphs at small batch (not hidden by two-batch "
                                         "overlap); SGLang reports 2-5 s TTFT / ~100 ms ITL only at full batch")
    max_running_per_gpu: int = fact(256, "seqs", "LMSYS 2025-05-05: 256 requests per decode GPU is the operating "
                                                 "point; the DeepEP low-latency buffer bounds tokens per rank")
    kv_transfer_efficiency: float = fact(0.5, "fraction", "assumption: PD KV transfer (Mooncake/NIXL RDMA) reaches "
                                                          "~half of NIC line rate per request")
    host_cache_gb_per_node: float = fact(0.0, "GB/node", "sensitivity floor for the host-DRAM prefix cache; the "
                                         "config's own SGLang HiCache settings (enable_hierarchical_cache, "
                                         "hicache_ratio x the GPU pool, or hicache_size_gb) are read from the plan; "
                                         "the file/NVMe tier behind it is not modelled")
    mem_fraction: float = fact(0.9, "fraction", "launcher/estimate.py SERVER_MEM_FRACTION; the config's "
                                                "inference.sglang.mem_fraction_static wins when set")
    dsa_topk: int = fact(2048, "tokens", "DeepSeek-V3.2 DSA: the lightning indexer selects the top-2048 keys per "
                                         "query (DeepSeek-V3.2-Exp report; FlashInfer dsa_topk_indexer_fp8 topk=2048); "
                                         "GLM-5 adopts DSA (GLM-5 report, arXiv 2602.15763)")
    indexer_cost_factor: float = fact(0.5, "x bf16 FLOPs", "DeepSeek-V3.2: the lightning indexer runs in FP8 "
                                                           "(half the bf16 time per FLOP)")
    fp8_inference: bool = fact(False, "", "config inference.dtype=bfloat16 (the trainer's dtype: no requantization "
                                           "per version); True is a sensitivity case: FP8 weights and GEMMs as the "
                                           "DeepSeek/SGLang anchors serve")
    spec_tokens_per_step: float = fact(1.0, "tokens/step", "assumption: no MTP speculative decoding (SGLang's "
                                       "large-scale EP blog lists MTP with DP attention as future work); GLM-5 "
                                       "ships 1 MTP layer, so >1 is a sensitivity case")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Training:
    train_tflops_per_gpu: float = fact(250.0, "TFLOP/s/GPU", "NVIDIA NeMo AutoModel performance highlights: "
                                       "DeepSeek V3 671B on 256 H100, BF16, TE + DeepEP: 250 TFLOPs/s/GPU, 1,002 "
                                       "tokens/s/GPU (MFU 25% of 989); Megatron-Core MoE reaches more on GB200/GB300 "
                                       "(1,048-1,233) but publishes no H100 number we can cite")
    max_gpus_per_sequence: int = fact(16, "GPUs", "assumption: context parallel x TP of at most 16 GPUs per "
                                                  "sequence; beyond that a 256-sequence batch cannot spread")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weights:
    update_overhead_s: float = fact(2.0, "s", "assumption: pause(in_place) + flush + per-bucket handshakes + "
                                              "continue, on top of the bytes on the wire")
    fs_gb_s: float = fact(100.0, "GB/s aggregate", "assumption: a mid-size Lustre/GPFS scratch; the filesystem "
                                                   "transport writes once and every replica reads a full copy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweWorkload:
    """Multi-turn SWE agent episodes (issue -> explore/edit/test loop -> final test run)."""

    max_context: int = fact(131_072, "tokens", "issue 10 (256 rollouts at up to 131k tokens); Golubev et al. 2025 "
                                               "(Nebius, arXiv 2508.03501) train SWE agents at 131k context")
    prompt_tokens: int = fact(6_000, "tokens", "assumption: system prompt with tool schemas + issue text")
    turns_median: float = fact(40.0, "turns", "assumption: Daytona's coding-agent RL benchmark uses 50-action "
                                              "trajectories (and 150-step ones, arXiv 2607.01415); agent step "
                                              "limits are typically 100")
    turns_p99_over_median: float = fact(2.5, "x", "assumption; capped at max_turns")
    max_turns: int = fact(100, "turns", "SWE-agent / OpenHands style step limit")
    decode_tokens_median: float = fact(250.0, "tokens/turn", "assumption: GLM-5 reasons before every tool call "
                                                             "(interleaved thinking) then emits the call")
    decode_tokens_p99_over_median: float = fact(8.0, "x", "assumption")
    tool_tokens_median: float = fact(500.0, "tokens/turn", "assumption: file views, diffs, test logs")
    tool_tokens_p99_over_median: float = fact(10.0, "x", "assumption")
    tool_latency_median_s: float = fact(0.5, "s", "Daytona 'hidden infrastructure tax': a 50-action SWE trajectory "
                                                  "takes 12.9 s (Daytona) to 20.1 s (Kubernetes), 0.26-0.4 s/action")
    tool_latency_p99_over_median: float = fact(40.0, "x", "assumption: builds and test runs make a Pareto tail "
                                                          "of tens of seconds")
    tool_latency_law: str = fact("pareto", "", "heavy tail (issue 10: lognormal or Pareto)")
    start_latency_median_s: float = fact(5.0, "s", "Daytona / arXiv 2607.01415: sandbox cold start, up to 110x "
                                                   "apart between substrates")
    reward_latency_median_s: float = fact(30.0, "s", "assumption: final test-suite run in the container")
    reward_latency_p99_over_median: float = fact(10.0, "x", "assumption (lognormal)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assumptions:
    hw: Hardware = dataclasses.field(default_factory=Hardware)
    serving: Serving = dataclasses.field(default_factory=Serving)
    training: Training = dataclasses.field(default_factory=Training)
    weights: Weights = dataclasses.field(default_factory=Weights)
    swe: SweWorkload = dataclasses.field(default_factory=SweWorkload)

    def with_changes(self, changes: dict[str, Any]) -> "Assumptions":
        """``{"serving.decode_step_overhead_s": 0.02}`` -> a copy with those fields replaced."""
        out = self
        for key, value in changes.items():
            section, name = key.split(".")
            part = getattr(out, section)
            if not hasattr(part, name):
                raise KeyError(f"unknown assumption {key!r}; see tools/simulator/assumptions.py")
            out = dataclasses.replace(out, **{section: dataclasses.replace(part, **{name: value})})
        return out

    def get(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(self, section), name)


# The published anchors describe DeepSeek-V3 serving; these are its architecture facts
# (DeepSeek-V3 technical report / HF config.json) needed to turn throughput into efficiency.
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,  # context 163840
                   num_experts=256, top_k=8, expert_intermediate_size=2048,
                   num_dense_layers=3, dense_intermediate_size=18432, num_shared_experts=1, attention="mla",
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   num_indexer_heads=0, indexer_head_dim=0, num_mtp_layers=1,
                   num_kv_heads=0, tie_word_embeddings=False)
ANCHOR_DECODE_NODES = 9  # LMSYS 2025-05-05: 3 prefill + 9 decode nodes; decode EP72
ANCHOR_DECODE_EXPERTS_PER_GPU = 4  # 256 + 32 redundant experts over 72 GPUs
ANCHOR_PREFILL_NODES = 4  # EP32 prefill in the same blog (its 4-node prefill benchmark)


def table(a: Assumptions) -> list[tuple[str, str, str, str]]:
    """(key, value, unit, source) rows, in declaration order."""
    rows = []
    for section in dataclasses.fields(a):
        part = getattr(a, section.name)
        for f in dataclasses.fields(part):
            rows.append((f"{section.name}.{f.name}", f"{getattr(part, f.name):g}" if isinstance(getattr(part, f.name), float)
                         else str(getattr(part, f.name)), f.metadata.get("unit", ""), f.metadata.get("source", "")))
    return rows
