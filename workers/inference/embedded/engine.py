"""Embedded generation engine for the tiny MoE: continuous batching on CPU, one thread.

Why it exists: local runs and CI need a real inference worker (SGLang cannot serve on
this CPU) that behaves like SGLang where the RL loop cares: per-token logprobs under the
sampling distribution, the experts every position was routed to, pause/continue and
in-place weight updates that keep requests and their KV cache.

How it runs: :class:`InferenceEngine` owns one thread that repeats a *step*: admit queued
requests up to ``max_batch_size``, prefill them together (left-padded), sample their first
token and join them to the running batch (the shorter KV cache is left-padded, key_mask
False); apply aborts; one decode step for every row; finished rows leave
(``KVCache.select``) and their callbacks fire. Two locks: ``_cond`` guards the request queue and flags (cheap, taken by HTTP handlers);
``_model_lock`` guards the parameters, the running batch and ``weight_version`` and is
held for a whole step, so weight copies and synchronous aborts happen between steps,
never during a forward. Lock order is always model lock, then ``_cond``.

Reproducibility: sampling draws from one ``torch.Generator`` seeded from (run seed,
worker rank); the draws a request sees still depend on which requests share its batch.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from workers.inference.embedded import fp8
from workers.inference.embedded.requests import GenOutput, GenRequest, _Seq  # noqa: F401  (re-exported)
from workers.inference.embedded.slot_state import nucleus
from workers.models.blocks.cache import KVCache
from workers.models.blocks.decoder import CausalLM
from workers.weights.base import WeightLoadError
from workers.weights.delta.apply import apply_chain
from workers.weights.filesystem.receiver import DiskReader
from workers.weights.lora_format import is_adapter_dir

log = logging.getLogger("slurmrl.inference")

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy


def engine_seed(run_seed: int, rank: int) -> int:
    """Distinct, reproducible sampling seed per worker (Generator wants a non-negative int)."""
    return (int(run_seed) * 1_000_003 + int(rank)) % (2**63 - 1)


class InferenceEngine:
    """Continuous-batching generator over one model; thread-safe public methods (see module doc)."""

    def __init__(self, model: CausalLM, *, max_batch_size: int, seed: int, weight_version: int = 0, lora=None):
        assert max_batch_size >= 1, max_batch_size
        self.model = model.eval()
        self.lora = lora  # LoRA mode: the adapters served on this base (workers/inference/embedded/lora.EngineLora)
        self.config = model.config  # the family's model section
        self.max_batch_size = max_batch_size
        self.max_seq_len = self.config.max_position_embeddings
        self.device = next(model.parameters()).device  # batches, sampling and the KV cache live here
        self.weight_version = weight_version
        self.model_path: Optional[str] = None
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._model_lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._disk, self.weight_hashes = DiskReader(), {}  # reused staging buffer; digests of what we hold
        self.weight_sums: dict[str, int] = {}  # sum64 per tensor of what we hold (patch steps find their base by it)
        self._cond = threading.Condition()
        self._pending: deque[_Seq] = deque()
        self._abort_rids: set[str] = set()  # marks applied at the next step (or by abort(wait=True))
        self._abort_all = False
        self._paused = self._stopping = False
        self._rows: list[_Seq] = []  # running batch, row i <-> cache row i
        self._admitting: list[_Seq] = []  # popped from the queue, in prefill: neither queued nor running
        self._cache: Optional[KVCache] = None
        self.error: Optional[BaseException] = None
        self.num_generated_tokens = self.num_steps = 0  # progress counters for /server_info
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="inference-engine", daemon=True)

    # ---- public API (thread-safe) ------------------------------------------------------
    def start(self) -> "InferenceEngine":
        self._thread.start()
        return self

    alive = property(lambda self: self._thread.is_alive() and self.error is None)
    failure = property(lambda self: None if self.error is None else
                       f"engine failed: {type(self.error).__name__}: {self.error}"[:1000],
                       doc="Why the engine died (None while it has not): the text failed requests carry.")
    paused = property(lambda self: self._paused)
    num_running = property(lambda self: len(self._rows), doc="Requests in the decode batch.")
    num_pending = property(lambda self: len(self._pending), doc="Requests queued (or held while paused).")

    def submit(self, req: GenRequest, on_done: Callable[[GenOutput], None]) -> None:
        """Queue ``req``; ``on_done`` is called once, from the engine thread (or the caller's
        thread for aborts), with the result. It must not block."""
        assert req.input_ids and len(req.input_ids) < self.max_seq_len, len(req.input_ids)
        seq = _Seq(req, on_done)
        if self.lora is not None:
            seq.adapter_id = self.lora.index(req.adapter)  # the server checked the name (KeyError otherwise)
        with self._cond:
            if not self._stopping:
                self._pending.append(seq)
                self._cond.notify_all()
                return
        if self.error is not None:
            self._finish(seq, {"type": "abort", "message": self.failure}, error=self.failure)
        else:
            self._finish(seq, {"type": "abort", "message": "engine is shutting down"})

    def generate(self, reqs: list[GenRequest], timeout_s: float = 60.0) -> list[GenOutput]:
        """Blocking convenience for tests and tools: submit all, wait for all."""
        outs: dict[str, GenOutput] = {}
        done = threading.Semaphore(0)
        for r in reqs:
            self.submit(r, lambda out: (outs.__setitem__(out.rid, out), done.release()))
        deadline = time.monotonic() + timeout_s
        for _ in reqs:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"engine finished {len(outs)}/{len(reqs)} requests in {timeout_s}s")
        return [outs[r.rid] for r in reqs]

    def abort(self, rids: Optional[Iterable[str]] = None, *, wait: bool) -> None:
        """Finish requests ``rids`` (None: all) with finish_reason abort.

        Queued ones finish at once. Running ones finish at the next step; with ``wait`` the
        caller takes the model lock and finishes them itself, which also works while paused.
        """
        wanted = None if rids is None else set(rids)
        with self._cond:
            gone = [s for s in self._pending if wanted is None or s.req.rid in wanted]
            self._pending = deque(s for s in self._pending if not (wanted is None or s.req.rid in wanted))
            self._abort_all |= wanted is None
            self._abort_rids |= wanted or set()
            self._cond.notify_all()
        for s in gone:
            self._finish(s, {"type": "abort", "message": "aborted while queued"})
        if wait:
            with self._model_lock:
                self._apply_aborts_locked()

    def pause(self, mode: str = "in_place") -> int:
        """Stop between steps; returns, once no forward runs, the requests held (running + queued).

        ``in_place`` keeps every request with its KV cache; ``abort`` finishes them all first.
        ``retract`` behaves like ``in_place`` here: SGLang frees retracted requests' KV cache
        and re-prefills them on continue, which gains nothing without memory pressure.
        """
        assert mode in ("in_place", "retract", "abort"), mode
        with self._cond:
            self._paused = True
        if mode == "abort":
            self.abort(None, wait=True)
        with self._model_lock:  # waits for the step in progress to end
            return self.num_running + self.num_pending

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update_weights_from_disk(self, model_path: str, weight_version: int, *, abort_all: bool = False) -> int:
        """Verify and load a published weights/step_N dir; returns the requests in flight.

        Reading and checksumming (weights.filesystem.DiskReader, which skips tensors the engine
        already holds) run outside the model lock, so decoding goes on. A missing, partial,
        corrupt or mis-shaped step raises WeightLoadError and leaves the old weights in place."""
        if abort_all:
            self.abort(None, wait=True)
        if self.lora is not None and is_adapter_dir(model_path):
            return self.load_adapter(model_path, weight_version)[0]
        with self._update_lock:  # a second update must not read against a half-applied first
            step = self._disk.load(Path(model_path), expected=self.model.state_dict(), known=self.weight_hashes,
                                   sums=self.weight_sums)
            n = self.apply_weights(step.state, weight_version, source=str(model_path), hashes=step.hashes,
                                   patches=step.patches, sums=step.sums)
        log.info("loaded weights v%d from %s: %.1f MB in %.3fs, %d tensors unchanged, %d requests in flight",
                 weight_version, model_path, step.bytes / 1e6, step.seconds, step.num_skipped, n)
        return n

    def load_adapter(self, path: str, weight_version: int, *, slot: int = 0) -> tuple[int, str]:
        """LoRA mode: read a published adapter step (outside the model lock) and copy it into adapter
        ``slot`` between steps, verified (workers/inference/embedded/lora.py); the engine then serves
        ``weight_version``. Returns (requests in flight, the digest of the adapter's tensors)."""
        from workers.inference.embedded.lora import read_step

        if self.lora is None:
            raise WeightLoadError(f"{path} is a LoRA adapter but this engine serves no adapters (trainer.lora.rank=0)")
        with self._update_lock:
            adapter = read_step(path)
            with self._model_lock:
                self.lora.load(adapter, slot=slot, version=int(weight_version))
                digest = self.lora.digest(slot)  # of the buffers the forward reads, not of the file
                self.weight_version = int(weight_version)
                self.model_path = str(path)
                self._weights_changed_locked()
                n = self.num_running + self.num_pending
        log.info("loaded adapter v%d (rank %d, %d targets) from %s into slot %d, digest %s, %d requests in flight",
                 weight_version, adapter.rank, len(adapter.tensors), path, slot, digest, n)
        return n, digest

    def _use_adapters(self, seqs) -> None:
        """LoRA mode: the adapter of each row of the next forward."""
        if self.lora is not None:
            self.lora.use(torch.tensor([s.adapter_id for s in seqs], device=self.device))

    def apply_weights(self, state, weight_version: int, *, source: str, hashes=None, patches=(), sums=None) -> int:
        """Copy verified tensors (any subset of the parameters) in between steps, cast to the
        model's dtype, then apply sparse ``patches`` in place (all or nothing: a digest mismatch puts
        every value back and raises WeightLoadError); ``hashes``: every parameter's digest afterwards,
        ``sums``: every tensor's sum64 (before the patches). Returns requests in flight."""
        params = self.model.state_dict()
        with self._model_lock, torch.no_grad():
            if patches:
                try:
                    sums = apply_chain(params, patches, sums or {})
                except WeightLoadError:  # all put back; what we hold is not what our sums say: the next
                    self.weight_sums = {}  # update goes through the anchor (patch_reader.py) instead
                    raise
            for name, t in state.items():
                params[name].copy_(t)
            self.weight_version = int(weight_version)
            self.model_path = source
            self.weight_hashes = dict(hashes or {})
            self.weight_sums = dict(sums or {})
            self._weights_changed_locked()
            return self.num_running + self.num_pending

    def patch_weights(self, patch, weight_version: int, *, source: str):
        """Run ``patch(params)`` (an in-place, verified patch: workers/weights/broadcast/delta_wire.py)
        in between steps; on success the engine serves ``weight_version``. The per-tensor hashes
        are dropped (they no longer describe the weights). Returns what ``patch`` returns."""
        with self._model_lock, torch.no_grad():
            out = patch(self.model.state_dict())
            self.weight_version = int(weight_version)
            self.model_path = source
            self.weight_hashes = {}
            self._weights_changed_locked()
            return out

    def set_weight_version(self, version: int) -> None:
        with self._model_lock:
            self.weight_version = int(version)
            self._weights_changed_locked()

    def _weights_changed_locked(self) -> None:
        """Hook for engines that keep copies of the weights or the version (the static engine's
        CUDA graphs: workers/inference/embedded/static_engine.py). Here: an fp8 model
        (inference.dtype=float8) re-quantizes the projections whose bf16 weights changed."""
        fp8.refresh(self.model)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything (callers get abort results) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.abort(None, wait=True)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)  # intra-op pool settings are per thread
        try:
            while True:
                with self._cond:
                    while not self._stopping and (self._paused or not (
                            self._pending or self._rows or self._abort_rids or self._abort_all)):
                        self._cond.wait()
                    if self._stopping:
                        return
                with self._model_lock, torch.inference_mode():
                    self._step_locked()
        except BaseException as e:  # a bug must fail requests loudly, not hang them
            log.exception("engine loop crashed")
            self.error = e
            with self._model_lock, self._cond:
                self._stopping = True
                # Do not touch the (possibly inconsistent) cache: just answer every caller,
                # including rows that were in prefill (popped from the queue, not yet running).
                failed = list(self._pending) + self._admitting + self._rows
                self._pending, self._admitting, self._rows, self._cache = deque(), [], [], None
            for s in failed:
                self._finish(s, {"type": "abort", "message": self.failure}, error=self.failure)

    def _step_locked(self) -> None:
        with self._cond:
            if self._paused or self._stopping:
                return  # paused after we left the wait: pause() promised no more forwards
            admit = []
            while self._pending and len(self._rows) + len(admit) < self.max_batch_size:
                admit.append(self._pending.popleft())
        if admit:
            self._admitting = admit  # a crash in the prefill still answers them
            self._prefill(admit)  # new rows join the batch with their first token sampled
            self._admitting = []
        # After the prefill, so an abort that raced with admission finds its row.
        self._apply_aborts_locked()
        self._retire_finished()  # new rows may be done already (stop token, max_new_tokens <= 1)
        if self._rows:
            self._decode()
            self._retire_finished()
        self.num_steps += 1

    def _apply_aborts_locked(self) -> None:
        with self._cond:
            rids, every = self._abort_rids, self._abort_all
            self._abort_rids, self._abort_all = set(), False
        if self._rows and (every or rids):
            hit = [every or s.req.rid in rids for s in self._rows]
            self._retire(hit, [{"type": "abort", "message": "aborted"}] * len(hit))

    def _prefill(self, seqs: list[_Seq]) -> None:
        lens = [len(s.req.input_ids) for s in seqs]
        n, t = len(seqs), max(lens)
        ids = torch.zeros(n, t, dtype=torch.long)
        mask = torch.zeros(n, t, dtype=torch.bool)
        pos = torch.zeros(n, t, dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, lens)):
            # Left padding keeps every row's last prompt token in the last column.
            ids[i, t - l:] = torch.tensor(s.req.input_ids)
            mask[i, t - l:] = True
            pos[i, t - l:] = torch.arange(l)
        cache = self.model.new_cache()
        ids, pos, mask = ids.to(self.device), pos.to(self.device), mask.to(self.device)
        self._use_adapters(seqs)
        out = self.model(ids, position_ids=pos, attention_mask=mask, cache=cache)
        routed = out.routed_experts.to(torch.int32)
        for i, (s, l) in enumerate(zip(seqs, lens)):
            if s.req.return_routed_experts:
                s.routed.append(routed[i, t - l:])
        self._sample_into(seqs, out.logits[:, -1], [s.req.max_new_tokens > 0 for s in seqs])
        self._merge(seqs, cache)

    def _merge(self, seqs: list[_Seq], cache: KVCache) -> None:
        if self._cache is None or not self._rows:
            self._rows, self._cache = seqs, cache
            return
        self._rows, self._cache = self._rows + seqs, self._cache.merge(cache)

    def _decode(self) -> None:
        rows = self._rows
        last = torch.tensor([[s.out_ids[-1]] for s in rows])
        pos = torch.tensor([[s.seqlen - 1] for s in rows])
        self._use_adapters(rows)
        out = self.model(last.to(self.device), position_ids=pos.to(self.device), cache=self._cache)
        if any(s.req.return_routed_experts for s in rows):
            routed = out.routed_experts.to(torch.int32)
            for i, s in enumerate(rows):
                if s.req.return_routed_experts:
                    s.routed.append(routed[i])
        self._sample_into(rows, out.logits[:, -1], [True] * len(rows))

    def _sample_into(self, seqs: list[_Seq], logits: torch.Tensor, wants: list[bool]) -> None:
        """Sample one token per row within its top-p nucleus; the logprob is under the temperature
        distribution (before the nucleus cut, as the static engine and SGLang report it), in float32."""
        temps = torch.tensor([s.req.temperature for s in seqs], dtype=torch.float32).to(self.device)
        greedy = temps < GREEDY_EPS
        logp = F.log_softmax(logits.float() / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
        tok = logp.argmax(-1)
        if not bool(greedy.all()):
            probs = logp.exp()
            top_p = [s.req.top_p for s in seqs]
            if min(top_p) < 1.0:  # top_p 1 keeps the full distribution (and the seeded draws) untouched
                probs = nucleus(probs, torch.tensor(top_p, dtype=torch.float32, device=self.device))
            # weights that overflow (a diverged trainer) give inf/NaN rows: draw those uniformly, so the engine
            # keeps serving and the non-finite logprob reaches the trainer, whose divergence check stops the run
            broken = ~torch.isfinite(probs).all(-1, keepdim=True)
            probs = torch.where(broken, torch.ones_like(probs), probs)
            drawn = torch.multinomial(probs, 1, generator=self._gen).squeeze(1)
            tok = torch.where(greedy, tok, drawn)
        lp = logp.gather(1, tok[:, None]).squeeze(1)
        for s, want, t, l in zip(seqs, wants, tok.tolist(), lp.tolist()):
            if want:
                s.out_ids.append(t)
                s.logprobs.append(l)
                s.versions.append(self.weight_version)
                self.num_generated_tokens += 1

    def _stop_reason(self, s: _Seq) -> Optional[dict]:
        if s.out_ids and s.out_ids[-1] in s.req.stop_token_ids:
            return {"type": "stop", "matched": s.out_ids[-1]}
        if len(s.out_ids) >= s.req.max_new_tokens or s.seqlen >= self.max_seq_len:
            return {"type": "length", "length": len(s.out_ids)}
        return None

    def _retire_finished(self) -> None:
        reasons = [self._stop_reason(s) for s in self._rows]
        self._retire([r is not None for r in reasons], reasons)

    def _retire(self, done: list[bool], reasons: list[Optional[dict]]) -> None:
        """Finish the rows flagged ``done`` and drop them (and dead cache columns)."""
        if not any(done):
            return
        keep = [i for i, d in enumerate(done) if not d]
        for i, d in enumerate(done):
            if d:
                self._finish(self._rows[i], reasons[i])
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = None
            return
        self._cache.select(torch.tensor(keep, device=self.device))
        self._cache.trim_left()

    def _finish(self, s: _Seq, reason: dict, error: Optional[str] = None) -> None:
        routed = None
        if s.req.return_routed_experts and s.routed and error is None:
            # The last sampled token was never fed, so it has no routing (SGLang's convention).
            routed = torch.cat(s.routed)[s.req.routed_experts_start_len: s.seqlen - 1].cpu().contiguous()
        out = GenOutput(rid=s.req.rid, prompt_tokens=len(s.req.input_ids), output_ids=s.out_ids,
                        logprobs=s.logprobs, token_versions=s.versions, finish_reason=reason,
                        weight_version=self.weight_version, routed_experts=routed,
                        latency_s=time.perf_counter() - s.t0, error=error)
        try:
            s.on_done(out)
        except Exception:  # a broken callback must not take the engine down
            log.exception("on_done callback of request %s failed", s.req.rid)
