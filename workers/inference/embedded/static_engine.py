"""The static embedded engine: fixed KV slots, chunked prefill, decode blocks replayed as CUDA graphs.

Why: the dynamic engine (workers/inference/embedded/engine.py) is host-bound on a GPU -- every
step it concatenates the KV cache, moves the sampled tokens to the host and loops over the
sequences in Python (issue 24: 0.63x transformers' generate on an H200). This engine keeps the
dynamic engine's contract (same requests, results, locks, pause/abort/weight-update semantics:
it subclasses :class:`InferenceEngine`) and changes how a step runs:

- every running request owns one slot of a preallocated cache
  (workers/inference/embedded/static_cache.py) and of the per-slot state
  (workers/inference/embedded/slot_state.py); a finished request frees its slot, and queued
  requests are admitted into free slots at step boundaries (continuous batching);
- admission prefills the new requests together, right-padded, ``prefill_chunk`` positions at a
  time (a long prompt never needs one huge attention matrix; the chunks see the earlier ones
  through the cache), then samples their first token;
- decode runs ``sync_every`` steps back to back over slots ``0..B-1`` (B: the smallest graph
  size covering the highest busy slot) attending over a key window that covers every running
  sequence until the block ends (a bound the host knows: prompt length + steps since admission);
  on CUDA each step is one CUDA-graph replay (captured on first use of its size, window and
  mode: cuda_graphs.py) that also samples, records logprobs, weight versions and routed experts
  and tests the stop conditions;
- only then does the host read the ``done`` flags (one small copy) and collect finished slots.
  A request that finishes mid-block idles (its writes go to scratch) until the block ends.

Reproducibility: greedy tokens equal the dynamic engine's; sampling uses the engine's seeded
generator (exponential race, slot_state.py), so draws depend on batch composition as before.
"""
from __future__ import annotations

import contextlib
import heapq
import logging
from typing import Optional

import torch

from workers.inference.embedded.cuda_graphs import DecodeGraphs, first_at_least, graph_batch_sizes, key_buckets
from workers.inference.embedded.engine import InferenceEngine
from workers.inference.embedded.requests import GenRequest, _Seq
from workers.inference.embedded.slot_state import GREEDY, MAX_STOP_IDS, NUCLEUS, SlotState, decode_mode, to_device
from workers.inference.embedded.static_cache import StaticKVCache, unsupported_reason
from workers.models.blocks import decode_attention, decode_kernels
from workers.models.blocks.decoder import CausalLM
from workers.models.blocks.latent_moe import LatentMoE
from workers.models.blocks.moe_softmax import MoeBlock

log = logging.getLogger("slurmrl.inference")


def choose_decode_attention(cfg, device: torch.device, dtype: torch.dtype, rows: int, windows: list[int]) -> None:
    """The decode-attention kernel where it checked out AND beats SDPA at this engine's shapes (timed once
    here, before any capture: workers/models/blocks/decode_attention.py); logs both times."""
    heads, kv = getattr(cfg, "num_heads", 0), getattr(cfg, "num_kv_heads", 0)
    if not (heads and kv) or heads % kv or not decode_attention.CHECKED.get(decode_kernels.device_key(device), False):
        return
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if hd not in (64, 128, 256):
        return
    try:
        kernel_us, sdpa_us = decode_attention.time_against_sdpa(
            device, dtype, rows=min(rows, 64), kv_heads=kv, group=heads // kv, head_dim=hd,
            windows=sorted({windows[0], min(windows[-1], 2048)}))
    except Exception as e:  # noqa: BLE001 - whatever went wrong, SDPA is the safe choice
        decode_attention.CHECKED[decode_kernels.device_key(device)] = False
        log.warning("static engine: timing the decode attention failed (%s: %s): SDPA runs", type(e).__name__, e)
        return
    log.info("static engine: decode attention %.1f us (kernel) vs %.1f us (SDPA) at %d x %d/%d heads of %d: %s",
             kernel_us, sdpa_us, min(rows, 64), heads, kv, hd, "kernel" if kernel_us <= sdpa_us else "SDPA")


class StaticEngine(InferenceEngine):
    """:class:`InferenceEngine` over fixed slots; ``cuda_graphs`` applies on CUDA devices only."""

    def __init__(self, model: CausalLM, *, max_batch_size: int, seed: int, weight_version: int = 0,
                 max_seq_len: int = 0, prefill_chunk: int = 512, sync_every: int = 8, cuda_graphs: bool = True,
                 smallest_key_window: int = 256, lora=None):
        super().__init__(model, max_batch_size=max_batch_size, seed=seed, weight_version=weight_version, lora=lora)
        assert prefill_chunk >= 1 and sync_every >= 1 and max_seq_len != 1, (prefill_chunk, sync_every, max_seq_len)
        if max_seq_len:  # 0: the model's max_position_embeddings, as the dynamic engine
            self.max_seq_len = min(int(max_seq_len), self.max_seq_len)  # the server refuses prompts that do not fit
        self.prefill_chunk, self.sync_every = prefill_chunk, sync_every
        dtype = next(model.parameters()).dtype
        self.slots = StaticKVCache(model, num_slots=max_batch_size, max_len=self.max_seq_len, device=self.device,
                                   dtype=dtype)
        routed_shape = (model.num_routed_layers, int(getattr(self.config, "top_k", 0) or 0))
        self.state = SlotState(num_slots=max_batch_size, max_len=self.max_seq_len, vocab=self.config.vocab_size,
                               routed_shape=routed_shape if routed_shape[0] else (0, 0), device=self.device)
        # LoRA mode: each slot's adapter id, written at admission; the captured decode reads [:b] in place
        self._slot_adapter = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self._free = list(range(max_batch_size))  # a heap: admission takes the lowest slots
        self._use_graphs = cuda_graphs and self.device.type == "cuda"
        if self.device.type == "cuda":  # before any capture: the fused decode kernels only where they check out
            for check in (decode_kernels.self_check, decode_attention.self_check):
                ok, why = check(self.device, dtype)
                (log.info if ok else log.warning)("static engine: %s", why)
        self._sizes = graph_batch_sizes(max_batch_size)  # eager steps pad the same way: the same kernels run
        self._windows = key_buckets(self.max_seq_len, smallest_key_window)
        if self.device.type == "cuda":
            choose_decode_attention(self.config, self.device, dtype, max_batch_size, self._windows)
        self._graphs = DecodeGraphs(self._decode_step, self._quiesced, self.device) if self._use_graphs else None
        self.graph_error: Optional[str] = None
        if self._use_graphs and dtype != torch.bfloat16 and any(isinstance(m, (MoeBlock, LatentMoE))
                                                                for m in model.modules()):
            log.warning("static engine: %s MoE experts (%s) have no grouped GEMM; under CUDA-graph capture they run "
                        "dense (every expert on every token): fine for tiny models, slow for large ones", dtype,
                        type(model).__name__)
        # Host copies of (done flag, tokens generated) per slot, then the non-finite flag: one read a block.
        self._pinned = torch.zeros(2 * max_batch_size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._retired_tokens = 0
        log.info("static engine: %d slots x %d positions (%.2f GiB KV cache), prefill chunk %d, host sync every "
                 "%d steps, CUDA graphs %s", max_batch_size, self.max_seq_len, self.slots.bytes / 2**30,
                 prefill_chunk, sync_every, "on" if self._use_graphs else "off")

    # ---- public API additions ----------------------------------------------------------
    def submit(self, req: GenRequest, on_done) -> None:
        if len(req.stop_token_ids) > MAX_STOP_IDS:
            msg = f"at most {MAX_STOP_IDS} stop_token_ids are supported, got {len(req.stop_token_ids)}"
            self._finish(_Seq(req, on_done), {"type": "abort", "message": msg}, error=msg)
            return
        super().submit(req, on_done)

    def _weights_changed_locked(self) -> None:
        """Captured graphs read the version tensor in place (weights, expert stacks included, are
        updated in place by the loaders, fp8 copies re-quantized in place: the graphs see them)."""
        super()._weights_changed_locked()
        self.state.version.fill_(int(self.weight_version))

    # ---- engine thread -----------------------------------------------------------------
    def _step_locked(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread's current device: graphs capture and replay there
        with self._cond:
            if self._paused or self._stopping:
                return
            admit = []
            while self._pending and len(admit) < len(self._free):
                admit.append(self._pending.popleft())
        if admit:
            self._admitting = admit
            for s in admit:
                s.slot = heapq.heappop(self._free)
            self._prefill(admit)
            self._rows = self._rows + admit
            self._admitting = []
        self._apply_aborts_locked()
        if self._rows:
            self._decode_block()
            self._collect()

    @contextlib.contextmanager
    def _quiesced(self):
        """Every slot inactive for a graph's warm-up runs (cuda_graphs.py says why that is harmless)."""
        active = self.state.active.clone()
        self.state.active.zero_()
        try:
            yield
        finally:
            self.state.active.copy_(active)

    def _step(self, b: int, window: int, sample: int) -> None:
        """One decode step: a graph replay (captured on first use), or eagerly. A failed capture
        leaves the slots as they were, so the engine goes on eagerly, saying so loudly:
        ``graph_error`` keeps why (the GPU tests and the benchmark report it)."""
        if self._graphs is not None:
            try:
                self._graphs.run((b, window, sample))
                return
            except Exception as e:  # noqa: BLE001 - any capture failure has the same remedy
                self._graphs, self._use_graphs = None, False
                self.graph_error = f"{type(e).__name__}: {e}"[:1000]
                log.error("CUDA graph capture failed, decoding without graphs: %s", self.graph_error)
        self._decode_step(b, window, sample)

    def _prefill(self, seqs: list[_Seq]) -> None:
        """Chunked, right-padded prefill of ``seqs`` into their slots, then their first token."""
        st, dev = self.state, self.device
        rows = st.admit([s.slot for s in seqs], [s.req for s in seqs], dev)
        if self.lora is not None:
            self._slot_adapter[rows] = torch.tensor([s.adapter_id for s in seqs], device=dev)
            self.lora.use(self._slot_adapter.index_select(0, rows))
        self.slots.reset(rows)  # recurrent (Mamba-2) states start from zero; keys are masked instead
        self.slots.live = None  # every admitted row is live
        lens = torch.tensor([len(s.req.input_ids) for s in seqs])
        n, t_max = len(seqs), int(lens.max())
        ids = torch.zeros(n, t_max, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s.req.input_ids)] = torch.tensor(s.req.input_ids)
        ids, lens_d = to_device(ids, dev), to_device(lens, dev)  # no wait for the decode queue (slot_state.to_device)
        last = torch.empty(n, self.config.vocab_size, device=dev, dtype=torch.float32)
        self.slots.use(rows, prefix=False)
        for c0 in range(0, t_max, self.prefill_chunk):
            t = min(self.prefill_chunk, t_max - c0)
            self.slots.window = first_at_least(self._windows, c0 + t)
            pos = torch.arange(c0, c0 + t, device=dev).expand(n, t)
            valid = pos < lens_d[:, None]
            ends = ((lens - 1 >= c0) & (lens - 1 < c0 + t)).nonzero()[:, 0]  # rows whose prompt ends here
            want = torch.zeros(n, t, dtype=torch.bool)
            want[ends, lens[ends] - 1 - c0] = True
            out = self.model(ids[:, c0:c0 + t], position_ids=pos, attention_mask=valid, cache=self.slots,
                             logits_mask=to_device(want, dev))
            if len(ends):
                last[to_device(ends, dev)] = out.logits.float()
            if out.routed_experts.shape[2]:
                st.record_routing(rows, pos, valid, out.routed_experts)
        mode = decode_mode([s.req for s in seqs])
        st.advance(rows, last, lens_d - 1, self._noise(n) if mode != GREEDY else None, cut=mode == NUCLEUS)
        for s in seqs:
            s.next_pos = len(s.req.input_ids)  # an upper bound of the position each row feeds next

    def _noise(self, n: int) -> torch.Tensor:
        return self.state.noise[:n].exponential_(generator=self._gen)

    def _decode_step(self, b: int, window: int, sample: int) -> None:
        """One token for slots 0..b-1 attending over key positions [0, window): pure device work
        (what the graphs capture). ``sample``: slot_state's GREEDY, SAMPLE or NUCLEUS (True: SAMPLE)."""
        st = self.state
        rows = st.arange[:b]
        self.slots.use(rows, prefix=True)
        self.slots.window = window
        self.slots.live = st.active[:b] & ~st.done[:b]  # rows whose recurrent state this step may advance
        fed = st.pos[:b]
        if self.lora is not None:
            self.lora.use(self._slot_adapter[:b])
        out = self.model(st.tok[:b, None], position_ids=fed[:, None], cache=self.slots)
        routed = out.routed_experts[:, 0] if out.routed_experts.shape[2] else None
        st.advance(rows, out.logits[:, -1], fed, st.noise[:b] if sample else None, routed, cut=sample == NUCLEUS)

    def _decode_block(self) -> None:
        n = 1 + max(s.slot for s in self._rows)
        sample = decode_mode([s.req for s in self._rows])
        b = first_at_least(self._sizes, n)
        # Rows feed positions up to next_pos + sync_every - 1 in this block; a query sees keys <= its position.
        window = first_at_least(self._windows, min(self.max_seq_len, max(s.next_pos for s in self._rows) + self.sync_every))
        for _ in range(self.sync_every):
            if sample:
                self._noise(b)
            self._step(b, window, sample)
        for s in self._rows:
            s.next_pos += self.sync_every
        self.num_steps += self.sync_every

    def _collect(self) -> None:
        """Read the done flags (one copy) and finish the slots that are done."""
        st, n = self.state, 1 + max(s.slot for s in self._rows)
        host = self._pinned[:2 * n]
        host.copy_(torch.cat([st.done[:n].long(), st.ngen[:n]]), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        done, ngen = host[:n].tolist(), host[n:2 * n].tolist()
        self._retire([bool(done[s.slot]) for s in self._rows], [None] * len(self._rows))
        self.num_generated_tokens = self._retired_tokens + sum(ngen[s.slot] for s in self._rows)

    def _retire(self, done: list[bool], reasons: list[Optional[dict]]) -> None:
        """Copy the finished slots' histories to their requests, answer them, free the slots."""
        if not any(done):
            return
        gone = [s for s, d in zip(self._rows, done) if d]
        why = [r for r, d in zip(reasons, done) if d]
        self._rows = [s for s, d in zip(self._rows, done) if not d]
        slots = [s.slot for s in gone]
        hist = self.state.history(slots, self.device)
        self.state.active[torch.tensor(slots, device=self.device)] = False
        for i, (s, reason) in enumerate(zip(gone, why)):
            p, k = len(s.req.input_ids), int(hist["ngen"][i])
            s.out_ids = hist["tokens"][i, p:p + k].tolist()
            s.logprobs = hist["logprobs"][i, p:p + k].tolist()
            s.versions = hist["versions"][i, p:p + k].tolist()
            if s.req.return_routed_experts:  # a dense model's record is [n, 0, 0], as the dynamic engine's
                routed = self.state.routed
                s.routed = [torch.zeros(s.seqlen - 1, 0, 0, dtype=torch.int32) if routed is None
                            else routed[s.slot, :s.seqlen - 1].to(torch.int32).cpu()]
            self._retired_tokens += k
            self._finish(s, reason if reason is not None else self._stop_reason(s))
            heapq.heappush(self._free, s.slot)


def create_engine(model: CausalLM, *, max_batch_size: int, seed: int, options=None,
                  weight_version: int = 0, lora=None) -> InferenceEngine:
    """The engine ``options`` (an EmbeddedInferenceConfig, or None: defaults) asks for.

    ``static_cache``: ``auto`` is the static engine on CUDA and the dynamic one on CPU; ``on``
    / ``off`` force it. Every builtin family fits the slots (GQA, MLA + DSA keys, Mamba-2 state);
    a model with a layer the slots cannot hold (two attention/mixer modules in one layer) falls
    back to the dynamic engine with a log line saying why."""
    mode = getattr(options, "static_cache", "auto")
    device = next(model.parameters()).device
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return InferenceEngine(model, max_batch_size=max_batch_size, seed=seed, weight_version=weight_version,
                               lora=lora)
    reason = unsupported_reason(model)
    if reason is not None:
        log.warning("static KV cache unavailable for %s (%s): using the dynamic engine",
                    getattr(model.config, "family", type(model).__name__), reason)
        return InferenceEngine(model, max_batch_size=max_batch_size, seed=seed, weight_version=weight_version,
                               lora=lora)
    kw = {k: getattr(options, k) for k in ("max_seq_len", "prefill_chunk", "sync_every", "cuda_graphs")
          if options is not None and hasattr(options, k)}
    return StaticEngine(model, max_batch_size=max_batch_size, seed=seed, weight_version=weight_version, lora=lora, **kw)
