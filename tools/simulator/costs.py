"""Seconds per role from FLOPs, bytes and the published anchors (cluster scale).

Why first principles plus anchors: a published throughput (DeepSeek-V3 on H100 in FP8)
does not transfer as-is to GLM-5 in bf16 at 50k-token contexts on H200. We therefore
count FLOPs and bytes for both models, derive from each anchor the efficiency the anchor
system achieved, and apply that efficiency to our model, dtype and layout:

  prefill   FLOPs(new tokens at their positions) / (GPUs x peak x eff_prefill)
  decode    one step of a replica = overhead + weights/HBM
                                    + max(EP all-to-all bytes / a2a bandwidth,        <- two-batch overlap
                                          tokens x FLOPs / (GPUs x peak x eff_decode) + KV bytes / HBM)
  train     3 x forward FLOPs (6 x active params + attention) / (GPUs x TFLOP/s per GPU)
  weights   max(bytes a receiving node needs / its NICs, bytes all senders push / theirs) + overhead

Attention counts DeepSeek Sparse Attention when the model has an indexer: each query
attends to at most ``dsa_topk`` keys, while the FP8 indexer scans the whole prefix.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tools.simulator.assumptions import (ANCHOR_DECODE_EXPERTS_PER_GPU, ANCHOR_DECODE_NODES, ANCHOR_PREFILL_NODES,
                                        DEEPSEEK_V3, Assumptions)
from launcher.estimate import attention_params, count_params, expert_params
from workers.models.facts import Architecture, architecture
from workers.weights.sglang.patch_cost import ServerLayout, delta_update_cost, model_split
from workers.weights.sglang.pull_cost import pull_seconds, pull_storage_bytes
from workers.weights.sglang.wire import update_cost

GPUS_PER_NODE = 8


class ModelFacts:
    """FLOPs and bytes per token of one architecture (a model section of any family, or its
    workers.models.facts.Architecture)."""

    def __init__(self, m, a: Assumptions):
        m = architecture(m)
        self.m, self.a = m, a
        p = count_params(m)
        self.active, self.total = p.active, p.total + p.mtp
        self.trained = p.total
        """What the trainer trains and publishes (MTP layers are served, not trained)."""
        num_moe = m.num_layers - m.num_dense_layers + m.num_mtp_layers
        self.routed = num_moe * m.num_experts * expert_params(m)
        self.routed_per_expert_layer = expert_params(m)
        self.num_moe_layers = m.num_layers - m.num_dense_layers
        self.replicated = self.total - self.routed
        self.dsa = m.attention == "mla" and m.num_indexer_heads > 0
        if m.attention == "mla":
            self.qk, self.v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
            self.latent = m.kv_lora_rank + m.qk_rope_head_dim
        else:
            self.qk = self.v = m.hidden_size // m.num_heads
            self.latent = 2 * m.hidden_size
        self.attn_params = attention_params(m)

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        """KV cache of one token over all layers: MLA latent + rope key (+ FP8 indexer key)."""
        idx = self.m.indexer_head_dim if self.dsa else 0
        return self.m.num_layers * (self.latent * dtype_bytes + idx)

    def _keys(self, n: int) -> float:
        """sum_{p<n} (keys the query at position p attends to)."""
        k = self.a.serving.dsa_topk if self.dsa else n
        return n * (n - 1) / 2 if n <= k else k * (k - 1) / 2 + (n - k) * k

    def _indexer(self, n: int) -> float:
        return n * (n - 1) / 2 if self.dsa else 0.0

    def prefill_flops(self, new: float, ctx0: float = 0.0) -> float:
        """Forward FLOPs of ``new`` tokens appended after ``ctx0`` cached ones (non-absorbed MLA)."""
        m, s = self.m, self.a.serving
        a, b = int(ctx0), int(ctx0 + new)
        attn = 2 * m.num_layers * m.num_heads * (self.qk + self.v) * (self._keys(b) - self._keys(a))
        idx = (2 * m.num_layers * m.num_indexer_heads * m.indexer_head_dim * s.indexer_cost_factor
               * (self._indexer(b) - self._indexer(a)))
        return 2.0 * self.active * new + attn + idx

    def train_flops(self, length: float) -> float:
        """Forward + backward (2x forward) of one whole sequence."""
        return 3.0 * self.prefill_flops(length, 0.0)

    def decode_flops(self, ctx: float) -> float:
        """One decoded token at context ``ctx`` (absorbed MLA: queries meet the latent directly)."""
        m, s = self.m, self.a.serving
        keys = min(ctx, s.dsa_topk) if self.dsa else ctx
        per_head = (self.latent + m.kv_lora_rank) if m.attention == "mla" else (self.qk + self.v)
        idx = 2 * m.num_indexer_heads * m.indexer_head_dim * ctx * s.indexer_cost_factor if self.dsa else 0.0
        return 2.0 * self.active + m.num_layers * (2 * m.num_heads * per_head * keys + idx)

    def decode_kv_read_bytes(self, ctx: float, dtype_bytes: int) -> float:
        keys = min(ctx, self.a.serving.dsa_topk) if self.dsa else ctx
        idx = ctx * self.m.indexer_head_dim if self.dsa else 0.0
        return self.m.num_layers * (keys * self.latent * dtype_bytes + idx)

    def a2a_bytes_per_token(self, dispatch_bytes: int, combine_bytes: int) -> float:
        """EP dispatch + combine traffic of one token over all MoE layers (top_k copies each way)."""
        return self.num_moe_layers * self.m.top_k * self.m.hidden_size * (dispatch_bytes + combine_bytes)

    def weights_bytes_per_gpu(self, *, gpus: int, ep: int, tp: int, dp_attention: int, dtype_bytes: float,
                              experts_per_gpu: float = 0.0) -> float:
        """Routed experts split over EP; the rest split over the attention TP group (tp / dp_attention)."""
        routed = (experts_per_gpu * self.routed / self.m.num_experts if experts_per_gpu else self.routed / ep)
        return (routed + self.replicated / max(1, tp // dp_attention)) * dtype_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replica:
    """One inference server of the plan (a SGLang replica or an embedded worker)."""

    kind: str  # prefill | decode | unified
    index: int
    num_gpus: int
    num_nodes: int
    tp: int = 1
    ep: int = 1
    dp_attention: int = 1
    hicache_ratio: float = 0.0
    """SGLang HiCache: host-memory prefix pool as a multiple of the GPU KV pool (0: off)."""
    hicache_gb_per_gpu: float = 0.0
    """SGLang --hicache-size (GB per rank); overrides the ratio when set."""
    max_batch_per_gpu: int = 0
    """SGLang --cuda-graph-max-bs: decode batch per DP rank (0: the assumption's default)."""
    max_running: int = 0
    """SGLang --max-running-requests for the whole server (0: inference.max_batch_size)."""
    redundant_experts: int = 0
    """EPLB redundant experts: extra expert copies spread over the EP ranks (more weights per GPU)."""


class ClusterCosts:
    """Role costs at cluster scale; efficiencies derived from the anchors on construction."""

    cpu_cores = None  # GPU roles do not share CPUs with each other
    orch_poll_s = trainer_poll_s = 0.0

    def __init__(self, model, a: Assumptions, *, infer_dtype: str, trainer_gpus: int, trainer_nodes: int,
                 max_batch_size: int, mem_fraction: float = 0.0):
        if mem_fraction:  # the config's SGLang --mem-fraction-static wins over the assumption
            a = a.with_changes({"serving.mem_fraction": mem_fraction})
        self.a, self.f = a, ModelFacts(model, a)
        fp8 = a.serving.fp8_inference
        self.infer_bytes = 1 if fp8 else {"bfloat16": 2, "float32": 4}[infer_dtype]
        self.infer_peak = (a.hw.fp8_tflops if fp8 else a.hw.bf16_tflops) * 1e12
        self.kv_dtype_bytes = 1 if fp8 else 2
        self.trainer_gpus, self.trainer_nodes = trainer_gpus, trainer_nodes
        self.max_batch_size = max_batch_size
        self.eff_prefill, self.eff_decode = derive_efficiencies(a)

    # -- decode ---------------------------------------------------------------------------------
    def a2a_gb_s(self, r: Replica) -> float:
        hw = self.a.hw
        return hw.nvlink_a2a_gb_s if r.num_nodes <= 1 else hw.nic_gb_s * hw.a2a_efficiency / (1 - 1 / r.num_nodes)

    def decode_step_s(self, r: Replica, n: int, ctx_sum: float) -> float:
        """Seconds of one decode iteration of replica ``r`` with ``n`` running sequences."""
        if n <= 0:
            return 0.0
        return decode_step(self.f, self.a, n=n, ctx=ctx_sum / n, gpus=r.num_gpus, nodes=r.num_nodes, tp=r.tp, ep=r.ep,
                           dp=r.dp_attention, dtype_bytes=self.infer_bytes, kv_bytes=self.kv_dtype_bytes,
                           peak=self.infer_peak, hbm=self.a.hw.hbm_tb_s * 1e12, a2a=self.a2a_gb_s(r) * 1e9,
                           eff=self.eff_decode, experts_per_gpu=self._experts_per_gpu(r)) / self.a.serving.spec_tokens_per_step

    def _experts_per_gpu(self, r: Replica) -> float:
        """EPLB's redundant copies add experts per GPU; 0 means the plain num_experts / ep."""
        return (self.f.m.num_experts + r.redundant_experts) / r.ep if r.redundant_experts else 0.0

    def decode_step_fn(self, r: Replica):
        """:meth:`decode_step_s` with the replica's constants folded in (the simulator's hot path)."""
        f, s, m = self.f, self.a.serving, self.f.m
        hbm, peak = self.a.hw.hbm_tb_s * 1e12, self.infer_peak
        fixed = s.decode_step_overhead_s + self.weights_per_gpu(r) / hbm
        comm = (f.a2a_bytes_per_token(self.infer_bytes, 2) / (self.a2a_gb_s(r) * 1e9) / r.num_gpus) if r.ep > 1 else 0.0
        per_head = (f.latent + m.kv_lora_rank) if m.attention == "mla" else (f.qk + f.v)
        topk = s.dsa_topk if f.dsa else float("inf")
        attn = m.num_layers * 2 * m.num_heads * per_head
        idx = m.num_layers * 2 * m.num_indexer_heads * m.indexer_head_dim * s.indexer_cost_factor if f.dsa else 0.0
        flop_t = 1.0 / (r.num_gpus * peak * self.eff_decode)
        kv_lat = m.num_layers * f.latent * self.kv_dtype_bytes / hbm / r.dp_attention
        kv_idx = (m.num_layers * m.indexer_head_dim / hbm / r.dp_attention) if f.dsa else 0.0
        active2, spec = 2.0 * f.active, s.spec_tokens_per_step

        def step(n: int, ctx_sum: float) -> float:
            if n <= 0:
                return 0.0
            ctx = ctx_sum / n
            keys = ctx if ctx < topk else topk
            work = n * ((active2 + attn * keys + idx * ctx) * flop_t + keys * kv_lat + ctx * kv_idx)
            c = n * comm
            return (fixed + (c if c > work else work)) / spec
        return step

    def weights_per_gpu(self, r: Replica) -> float:
        return self.f.weights_bytes_per_gpu(gpus=r.num_gpus, ep=r.ep, tp=r.tp, dp_attention=r.dp_attention,
                                            dtype_bytes=self.infer_bytes, experts_per_gpu=self._experts_per_gpu(r))

    def kv_capacity_tokens(self, r: Replica, gpu_gb: float) -> float:
        free = gpu_gb * 1e9 * self.a.serving.mem_fraction - self.weights_per_gpu(r)
        return max(0.0, free) * r.num_gpus / self.f.kv_bytes_per_token(self.kv_dtype_bytes)

    def prefix_cache_tokens(self, r: Replica, gpu_gb: float) -> float:
        """GPU KV room plus HiCache's host pool (the config's ratio or size, or the assumption's GB/node)."""
        gpu = self.kv_capacity_tokens(r, gpu_gb)
        per_token = self.f.kv_bytes_per_token(self.kv_dtype_bytes)
        host = max(r.hicache_gb_per_gpu * 1e9 * r.num_gpus / per_token if r.hicache_gb_per_gpu else gpu * r.hicache_ratio,
                   self.a.serving.host_cache_gb_per_node * 1e9 * r.num_nodes / per_token)
        return gpu + host

    def max_running(self, r: Replica) -> int:
        per_gpu = r.max_batch_per_gpu or self.a.serving.max_running_per_gpu
        return min(r.max_running or self.max_batch_size, per_gpu * r.dp_attention if r.dp_attention > 1 else per_gpu)

    # -- prefill / transfer ---------------------------------------------------------------------
    def prefill_flops(self, new: float, ctx0: float) -> float:
        return self.f.prefill_flops(new, ctx0)

    def prefill_rate(self, r: Replica) -> float:
        return r.num_gpus * self.infer_peak * self.eff_prefill

    def kv_transfer_s(self, ctx: float) -> float:
        s = self.a.serving
        return ctx * self.f.kv_bytes_per_token(self.kv_dtype_bytes) / (self.a.hw.nic_gb_s * 1e9 * s.kv_transfer_efficiency)

    # -- trainer / weights ----------------------------------------------------------------------
    def train_s(self, lengths: Sequence[int]) -> float:
        t = self.a.training
        gpus = min(self.trainer_gpus, len(lengths) * t.max_gpus_per_sequence)
        return sum(self.f.train_flops(n) for n in lengths) / (gpus * t.train_tflops_per_gpu * 1e12)

    def train_sleep_s(self) -> float:
        return 0.0

    def weight_sync(self, replicas: Sequence[Replica], transport: str = "broadcast", *,
                    delta_fraction: float = 0.0) -> tuple[float, float]:
        """(seconds the trainer spends publishing, seconds inference is paused) for one update.

        bf16 (the trainer's dtype; replicas requantize nothing). Broadcast: SGLang's own protocol
        (workers/weights/sglang/wire.update_cost, the figure the plan prints): every
        server GPU receives the whole model, pipelined along one NCCL broadcast at the NIC's
        rate. Filesystem: one write, then a full read per replica, through the shared
        filesystem's aggregate bandwidth. Broadcast with sparse patches (``delta_fraction`` > 0):
        workers/weights/sglang/patch_cost.delta_update_cost's whole-patch figure, the plan's too.
        Filesystem with sparse patches: the patch is written once; every server rank pulls its share
        (delta_update_cost's per-rank figure) at its NIC's rate, or slower where the storage cannot serve
        all ranks' reads at once (workers/weights/sglang/pull_cost.py: the plan prints the same).
        """
        hw, w = self.a.hw, self.a.weights
        need = [self.weights_per_gpu(r) * r.num_gpus for r in replicas]
        if transport == "filesystem" and delta_fraction > 0:
            c = delta_update_cost(model_split(self.f.m), self._layouts(replicas), item_bytes=int(self.infer_bytes),
                                  fraction=delta_fraction, nic_gb_s=hw.nic_gb_s, senders=1, efficiency=1.0)
            storage = pull_storage_bytes(model_split(self.f.m), self._layouts(replicas),
                                         bytes_per_element=c.bytes_per_element, gpus_per_node=GPUS_PER_NODE)
            pull = pull_seconds(c.rank_bytes_per_gpu, storage, nic_gb_s=hw.nic_gb_s, fs_gb_s=w.fs_gb_s)
            return c.whole_bytes_per_gpu / (w.fs_gb_s * 1e9), w.update_overhead_s + pull
        if transport == "filesystem":
            write = self.f.total * 2 / (w.fs_gb_s * 1e9)
            return write, w.update_overhead_s + sum(need) / (w.fs_gb_s * 1e9)
        if delta_fraction > 0:
            wire = delta_update_cost(model_split(self.f.m), self._layouts(replicas), item_bytes=int(self.infer_bytes),
                                     fraction=delta_fraction, nic_gb_s=hw.nic_gb_s, senders=self.trainer_gpus,
                                     efficiency=hw.bulk_efficiency).whole_s
            return wire, w.update_overhead_s + wire
        _, wire = update_cost(self.f.trained * self.infer_bytes, hw.nic_gb_s, hw.bulk_efficiency)
        return wire, w.update_overhead_s + wire

    @staticmethod
    def _layouts(replicas: Sequence[Replica]) -> list[ServerLayout]:
        """Each replica as one server of sglang/patch_cost's layouts (how it spreads the model over its GPUs)."""
        return [ServerLayout(count=1, tp=r.tp, ep=r.ep, dp_attention=r.dp_attention,
                             redundant_experts=r.redundant_experts) for r in replicas]


def decode_step(f: ModelFacts, a: Assumptions, *, n: float, ctx: float, gpus: int, nodes: int, tp: int, ep: int, dp: int,
                dtype_bytes: float, kv_bytes: int, peak: float, hbm: float, a2a: float, eff: float,
                experts_per_gpu: float = 0.0, dispatch_bytes: int = 0) -> float:
    """One decode iteration (see the module docstring); ``n`` sequences over ``gpus`` GPUs."""
    weights = f.weights_bytes_per_gpu(gpus=gpus, ep=ep, tp=tp, dp_attention=dp, dtype_bytes=dtype_bytes,
                                      experts_per_gpu=experts_per_gpu)
    comm = 0.0
    if ep > 1:
        comm = n / gpus * f.a2a_bytes_per_token(dispatch_bytes or int(dtype_bytes), 2) / a2a
    compute = n * f.decode_flops(ctx) / (gpus * peak * eff)
    kv = n / dp * f.decode_kv_read_bytes(ctx, kv_bytes) / hbm
    return a.serving.decode_step_overhead_s + weights / hbm + max(comm, compute + kv)


def derive_efficiencies(a: Assumptions) -> tuple[float, float]:
    """(prefill, decode) fraction of peak that the published DeepSeek-V3 deployment achieved.

    Prefill: anchor tokens/s x FLOPs per token / (8 GPUs x FP8 peak). Decode: the compute
    efficiency that makes :func:`decode_step` reproduce the anchor's ITL at its batch, given
    H100 HBM (3.35 TB/s), FP8 weights and dispatch, bf16 combine and EP72 across 9 nodes.
    """
    s, hw = a.serving, a.hw
    v3 = ModelFacts(Architecture(**DEEPSEEK_V3), a.with_changes({"serving.dsa_topk": 10**9}))
    ctx = s.anchor_decode_ctx
    per_req = v3.prefill_flops(ctx, 0)
    eff_prefill = s.anchor_prefill_tok_s_node / ctx * per_req / (GPUS_PER_NODE * hw.fp8_tflops * 1e12)
    gpus = ANCHOR_DECODE_NODES * GPUS_PER_NODE
    n = s.anchor_decode_batch_per_gpu * gpus
    h100_hbm = 3.35e12
    a2a = hw.nic_gb_s * 1e9 * hw.a2a_efficiency / (1 - 1 / ANCHOR_DECODE_NODES)
    common = dict(n=n, ctx=ctx, gpus=gpus, nodes=ANCHOR_DECODE_NODES, tp=gpus, ep=gpus, dp=gpus, dtype_bytes=1,
                  kv_bytes=2, peak=hw.fp8_tflops * 1e12, hbm=h100_hbm, a2a=a2a,
                  experts_per_gpu=ANCHOR_DECODE_EXPERTS_PER_GPU, dispatch_bytes=1)
    # decode_step is increasing in 1/eff; bisect on eff so the anchor's ITL comes out.
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if decode_step(v3, a, eff=mid, **common) > s.anchor_decode_itl_s:
            lo = mid
        else:
            hi = mid
    return eff_prefill, hi


def anchor_check(a: Assumptions) -> dict[str, float]:
    """What the derived efficiencies mean, for the printed assumptions table."""
    eff_p, eff_d = derive_efficiencies(a)
    return {"eff_prefill": eff_p, "eff_decode": eff_d, "anchor_prefill_nodes": ANCHOR_PREFILL_NODES}
