"""Per-slot decode state of the static engine, on the device, and the one step that advances it.

Why on the device: the dynamic engine moves every sampled token to the host, appends it to a
Python list per sequence and builds the next input from those lists, one host sync and one
Python loop over sequences per step. Here the next input (``tok``, ``pos``), the stop test and
the history a response needs (tokens, logprobs, weight versions, routed experts) are written
by tensor ops into fixed buffers indexed by slot and position, so a decode step is pure device
work that a CUDA graph can replay (workers/inference/embedded/cuda_graphs.py); the host reads
``done`` every few steps and a finished slot's history once.

Index conventions: a sequence's token at position ``p`` is ``tokens[slot, p]`` (the prompt is not
stored; generated tokens start at ``p = prompt_len``), its logprob and weight version sit at the
same index, and ``routed[slot, p]`` is the routing of the token FED at position ``p``. Column
``max_len`` is scratch: rows that are not live (free slot, already finished, padding up to a
captured batch size) write there, so a step never has to branch on which rows are live.

Sampling: greedy rows take the argmax (bit-equal to the dynamic engine); sampled rows draw from
softmax(logits / temperature) restricted to the top-p nucleus by the exponential race
``argmax p_i / E_i`` with ``E ~ Exp(1)`` drawn from the engine's seeded generator outside the
graph (``noise``); the logprob is under the temperature distribution, as the dynamic engine's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

GREEDY_EPS = 1e-6  # as workers/inference/embedded/engine.py: SGLang treats lower temperatures as greedy
MAX_STOP_IDS = 16  # stop tokens a request may name (a fixed column count, for the graphs)


#: Decode modes (a CUDA graph per mode): every row greedy; sampling; sampling with a top-p nucleus.
GREEDY, SAMPLE, NUCLEUS = 0, 1, 2


def decode_mode(reqs) -> int:
    """The cheapest mode that serves ``reqs``: the nucleus (a sort of every row's vocabulary: the
    costliest kernel of a small model's decode step) only when a sampled request asks for top_p < 1."""
    sampled = [r for r in reqs if r.temperature >= GREEDY_EPS]
    if not sampled:
        return GREEDY
    return NUCLEUS if any(float(getattr(r, "top_p", 1.0)) < 1.0 for r in sampled) else SAMPLE


def sample_tokens(logits: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor,
                  noise: Optional[torch.Tensor], cut: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its logprob [B] float32) for logits [B, V]; ``noise`` None: greedy only.
    ``cut`` False skips the top-p cut (every row's top_p is 1: the whole distribution)."""
    greedy = temp < GREEDY_EPS
    logp = F.log_softmax(logits.float() / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    tok = logp.argmax(-1)
    if noise is not None:
        probs = logp.exp()
        # weights that overflow (a diverged trainer) give inf/NaN rows: those are drawn uniformly, as in the
        # dynamic engine, so the engine keeps serving and the non-finite logprob reaches the trainer's check
        broken = ~torch.isfinite(probs).all(-1, keepdim=True)
        probs = torch.where(broken, torch.ones_like(probs), nucleus(probs, top_p) if cut else probs)
        tok = torch.where(greedy, tok, (probs / noise).argmax(-1))
    return tok, logp.gather(1, tok[:, None])[:, 0]


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``probs`` [B, V] with every token outside row b's top-``top_p[b]`` nucleus set to 0 (not
    renormalised: both samplers are scale-free). The nucleus is the smallest set of most likely
    tokens whose mass reaches top_p (SGLang's rule); the most likely token is always in it."""
    sp, si = probs.sort(dim=-1, descending=True)
    outside = (sp.cumsum(-1) - sp) >= top_p[:, None]  # mass before the token already reached top_p
    return probs.masked_fill(torch.zeros_like(outside).scatter_(1, si, outside), 0.0)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (on the host) on ``device`` without making the host wait for the device's queue: on CUDA
    through pinned memory (torch's caching host allocator keeps the block until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SlotState:
    """Device buffers for ``num_slots`` sequences of up to ``max_len`` positions."""

    def __init__(self, *, num_slots: int, max_len: int, vocab: int, routed_shape: tuple[int, int], device):
        s, n, d = num_slots, max_len, device
        self.max_len = max_len
        self.arange = torch.arange(s, device=d)
        self.tok = torch.zeros(s, dtype=torch.long, device=d)  # next token to feed
        self.pos = torch.zeros(s, dtype=torch.long, device=d)  # its position
        self.active = torch.zeros(s, dtype=torch.bool, device=d)
        self.done = torch.zeros(s, dtype=torch.bool, device=d)
        self.ngen = torch.zeros(s, dtype=torch.long, device=d)
        self.max_new = torch.zeros(s, dtype=torch.long, device=d)
        self.temp = torch.zeros(s, dtype=torch.float32, device=d)
        self.top_p = torch.ones(s, dtype=torch.float32, device=d)
        self.stop = torch.full((s, MAX_STOP_IDS), -1, dtype=torch.long, device=d)
        self.noise = torch.ones(s, vocab, dtype=torch.float32, device=d)
        self.version = torch.zeros(1, dtype=torch.int32, device=d)
        self.tokens = torch.zeros(s, n + 1, dtype=torch.long, device=d)
        self.logprobs = torch.zeros(s, n + 1, dtype=torch.float32, device=d)
        self.versions = torch.zeros(s, n + 1, dtype=torch.int32, device=d)
        layers, k = routed_shape
        self.routed = torch.zeros(s, n + 1, layers, k, dtype=torch.int16, device=d) if layers else None

    def admit(self, slots: list[int], reqs: list, device) -> torch.Tensor:
        """Reset ``slots`` for new requests; returns them as a device tensor.

        Every field travels in ONE host -> device copy (float64 holds slot numbers, token ids and
        the float32 temperatures exactly), from pinned memory on CUDA: a copy from pageable memory
        makes the host wait until the device's queue drains, and one per field did so five times
        per admission while other requests were decoding."""
        fields = [[s, r.max_new_tokens, float(r.temperature), float(getattr(r, "top_p", 1.0))]
                  + list(r.stop_token_ids) + [-1] * (MAX_STOP_IDS - len(r.stop_token_ids)) for s, r in zip(slots, reqs)]
        host = torch.tensor(fields, dtype=torch.float64)
        dev = to_device(host, device)
        idx = dev[:, 0].long()
        self.active[idx] = True
        self.done[idx] = dev[:, 1] <= 0
        self.ngen[idx] = 0
        self.max_new[idx] = dev[:, 1].long()
        self.temp[idx] = dev[:, 2].float()
        self.top_p[idx] = dev[:, 3].float()
        self.stop[idx] = dev[:, 4:].long()
        return idx

    def record_routing(self, rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, routed: torch.Tensor) -> None:
        """``routed`` [B, T, L_routed, k] of the tokens fed at ``pos`` [B, T] (pads to scratch)."""
        if self.routed is not None:
            self.routed[rows[:, None], torch.where(valid, pos, self.max_len)] = routed.to(self.routed.dtype)

    def advance(self, rows: torch.Tensor, logits: torch.Tensor, fed_pos: torch.Tensor,
                noise: Optional[torch.Tensor], routed: Optional[torch.Tensor] = None, cut: bool = True) -> None:
        """Sample after the tokens fed at ``fed_pos`` [B] in slots ``rows`` [B]; record, test stop,
        set up the next input. Rows not live (inactive or done) change nothing but scratch."""
        live = self.active[rows] & ~self.done[rows]
        tok, lp = sample_tokens(logits, self.temp[rows], self.top_p[rows], noise, cut)
        nxt = fed_pos + 1
        at = torch.where(live, nxt, self.max_len)
        self.tokens[rows, at] = tok
        self.logprobs[rows, at] = lp
        self.versions[rows, at] = self.version.expand(rows.shape[0])
        if routed is not None and self.routed is not None:
            self.routed[rows, torch.where(live, fed_pos, self.max_len)] = routed.to(self.routed.dtype)
        ngen = self.ngen[rows] + live.long()
        self.ngen[rows] = ngen
        stopped = (tok[:, None] == self.stop[rows]).any(-1) | (ngen >= self.max_new[rows]) | (nxt + 1 >= self.max_len)
        self.done[rows] = self.done[rows] | (live & stopped)
        self.tok[rows] = torch.where(live, tok, self.tok[rows])
        self.pos[rows] = torch.where(live, nxt, fed_pos)

    def history(self, slots: list[int], device) -> dict[str, torch.Tensor]:
        """Finished slots' generated counts and per-position records, on the host (one copy each)."""
        idx = torch.tensor(slots, device=device)
        return {"ngen": self.ngen[idx].cpu(), "tokens": self.tokens[idx].cpu(), "logprobs": self.logprobs[idx].cpu(),
                "versions": self.versions[idx].cpu()}
