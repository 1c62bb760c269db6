"""LoRA adapters served on the frozen base without merging (issue 44, items 3 and 5).

Why not merge: a merged update rewrites every targeted base weight (the whole model, dense or
MoE, for every step), which is what LoRA RL exists to avoid; and merging in the inference dtype
rounds the base differently every version. Here the base never changes after step 0; an update
copies the adapter (``r * (in + out)`` numbers per target) into buffers allocated once, and the
forward adds it:

    y = base(x) + ((x @ A^T) * mask) @ B^T

per targeted ``nn.Linear`` (a forward hook: the module, its state dict and the base digest stay
as they are). ``A`` is ``[S*r, in]``, ``B`` ``[out, S*r]``: the ``S`` served adapters side by side,
each ``r`` (the largest rank, ``trainer.lora.rank``) rows wide; ``mask`` [rows, S*r] holds, for each
batch row, its adapter's scale (``alpha / r``) on that adapter's block and 0 elsewhere, gathered from
a table by the row's adapter id (id ``S``: the base alone). So one batched matmul pair serves every
adapter at once (several adapters on one base, item 5), and a smaller-rank adapter is zero-padded.

Routed experts: the MoE block's ``routed_experts`` is replaced (an instance attribute) by a
sorted-rows version whose base and adapter products are grouped GEMMs over all experts
(``F.grouped_mm``; A ``[E, S*r, in]``, B ``[E, out, S*r]`` per stack: ``gate_up_proj`` or ``up_proj``,
and ``down_proj``): no per-expert Python loop, no host sync. Adapters are loaded by whole stacks
(one copy per stack), never expert by expert.

CUDA graphs: every buffer (A, B, the scale table, the per-slot adapter ids the static engine keeps)
is allocated before the first capture and only ever written in place, and the mask is computed
inside the captured forward from the ids (``index_select``), so graphs captured once stay valid
across adapter versions and adapter switches.

Confirmation (the verl #7495 bug: an adapter never reached the engine while training went on):
:meth:`EngineLora.load` copies, then compares every buffer block with what it was given (exact, in
the buffer's dtype); :meth:`EngineLora.digest` reads the buffers BACK (what the forward uses) under
the PEFT names of workers/weights/lora_format.py and hashes them (``state_digest`` of their xxh3s);
the orchestrator compares that with the trainer's (workers/weights/lora_steps.py) before it samples
from the version. A load that silently did nothing leaves the old adapter's digest: refused.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.experts import StackedExperts
from workers.weights.base import WeightLoadError
from workers.weights.lora_format import Adapter, peft_state
from workers.weights.lora_publisher import adapter_files_digest

log = logging.getLogger("slurmrl.inference")

EXPERTS = "experts"
"""The target name (``trainer.lora.targets``) that adapts every routed-expert stack."""


def _block(t: torch.Tensor, dim: int, slot: int, r: int) -> torch.Tensor:
    """Adapter ``slot``'s ``r`` columns (``dim``) of a side-by-side buffer."""
    return t.narrow(dim, slot * r, r)


class _Pair:
    """One target's buffers: ``a`` [*lead, S*r, in], ``b`` [*lead, out, S*r] (lead: ``[E]`` for a stack)."""

    def __init__(self, lead: Sequence[int], out_f: int, in_f: int, slots: int, r: int, like: torch.Tensor):
        kw = dict(dtype=like.dtype, device=like.device)
        self.a = torch.zeros(*lead, slots * r, in_f, **kw)
        self.b = torch.zeros(*lead, out_f, slots * r, **kw)

    def put(self, slot: int, r: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
        """Write one adapter's factors into ``slot`` (zeros when ``a`` is None), rank-padded."""
        da, db = _block(self.a, -2, slot, r), _block(self.b, -1, slot, r)
        da.zero_()
        db.zero_()
        if a is None:
            return
        rk = a.shape[-2]
        da.narrow(-2, 0, rk).copy_(a)
        db.narrow(-1, 0, rk).copy_(b)

    def holds(self, slot: int, r: int, a: torch.Tensor, b: torch.Tensor) -> bool:
        rk = a.shape[-2]
        da, db = _block(self.a, -2, slot, r), _block(self.b, -1, slot, r)
        return (torch.equal(da.narrow(-2, 0, rk), a.to(da.dtype)) and torch.equal(db.narrow(-1, 0, rk), b.to(db.dtype))
                and not da.narrow(-2, rk, r - rk).any() and not db.narrow(-1, rk, r - rk).any())


def grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` sorted by expert (group ends ``offs``) times their expert's ``w`` [E, out, in]^T.
    ``F.grouped_mm`` (one kernel for all experts) where it runs: CPU, or CUDA bf16 with 16-byte widths
    (slots are padded to 8 ranks on CUDA for it). Else (CUDA float32: tiny models under the static
    engine's graphs, as the base experts run dense there) each row's expert matrix is gathered and
    batched: n x out x in elements, for tiny shapes only."""
    if not x.is_cuda or (x.dtype == torch.bfloat16 and not any(d % 8 for d in w.shape[1:])):
        return F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    # CUDA float32 (tiny models under the static engine's graphs): each row's expert matrix, batched
    eid = torch.bucketize(torch.arange(x.shape[0], device=x.device), offs.long(), right=True).clamp_max(w.shape[0] - 1)
    return torch.bmm(w.index_select(0, eid), x[:, :, None])[:, :, 0]


class EngineLora:
    """``num_adapters`` adapter slots of rank ``rank`` on ``model``'s ``targets`` (module docstring).

    ``targets``: leaf names of ``nn.Linear`` modules (``q_proj``, ``down_proj``, ...) and/or ``experts``;
    the router, embeddings and head are never adapted. ``names``: the adapters' names (requests pick
    one by name, SGLang's ``lora_path``); default one adapter, ``default``."""

    def __init__(self, model: nn.Module, *, rank: int, targets: Iterable[str], num_adapters: int = 1,
                 names: Optional[Sequence[str]] = None):
        if rank < 1 or num_adapters < 1:
            raise ValueError(f"lora: rank {rank} and num_adapters {num_adapters} must be >= 1")
        like = next(model.parameters())
        # on CUDA each slot is padded to a multiple of 8 ranks (zeros): bf16 grouped GEMMs need 16-byte widths
        self.rank, self.slots = (-(-int(rank) // 8) * 8 if like.is_cuda else int(rank)), int(num_adapters)
        self.names = list(names) if names is not None else (["default"] if num_adapters == 1 else
                                                            [f"adapter{i}" for i in range(num_adapters)])
        assert len(self.names) == self.slots, (self.names, self.slots)
        targets = set(targets)
        self.dense: dict[str, _Pair] = {}
        self.stacks: dict[str, _Pair] = {}
        self.versions: list[Optional[int]] = [None] * self.slots  # the version each slot holds
        self.held: list[Optional[tuple]] = [None] * self.slots  # (rank, scale, targets) each slot holds
        for name, mod in model.named_modules():
            leaf = name.rpartition(".")[2]
            if isinstance(mod, nn.Linear) and leaf in targets and leaf not in ("gate", "lm_head"):
                pair = self.dense[name] = _Pair((), mod.out_features, mod.in_features, self.slots, self.rank, like)
                mod.register_forward_hook(self._dense_hook(pair))
            elif EXPERTS in targets and hasattr(mod, "experts") and isinstance(mod.experts, StackedExperts):
                ex = mod.experts
                for stack in ex.stacks():
                    e, out_f, in_f = getattr(ex, stack).shape
                    self.stacks[f"{name}.experts.{stack}"] = _Pair((e,), out_f, in_f, self.slots, self.rank, like)
                mod.routed_experts = self._experts_forward(mod, f"{name}.experts")
        if not self.dense and not self.stacks:
            raise ValueError(f"lora: none of targets {sorted(targets)} is a module of {type(model).__name__}")
        # table row s: adapter s's scale on its block; row S: all zeros (the base alone)
        self.table = torch.zeros(self.slots + 1, self.slots * self.rank, dtype=like.dtype, device=like.device)
        self.ids = torch.zeros(1, dtype=torch.long, device=like.device)
        self._mask: Optional[torch.Tensor] = None
        model.register_forward_pre_hook(self._new_forward)
        self.nbytes = sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                          for p in [*self.dense.values(), *self.stacks.values()])
        log.info("lora: %d dense targets, %d expert stacks, %d adapter slot(s) of rank %d (%.1f MB of buffers)",
                 len(self.dense), len(self.stacks), self.slots, self.rank, self.nbytes / 1e6)

    # ---- which adapter each row uses ---------------------------------------------------
    @property
    def base_id(self) -> int:
        """The id of "no adapter" (the base model alone)."""
        return self.slots

    def index(self, name: Optional[str]) -> int:
        """Adapter id of a request's adapter name (None: the first adapter); KeyError names the choices."""
        if name is None:
            return 0
        if name == "base":
            return self.base_id
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"unknown adapter {name!r}; this server serves {self.names} (or 'base')") from None

    def use(self, ids: torch.Tensor) -> None:
        """Adapter id of each batch row of the next forward(s) (a view of a persistent buffer under
        CUDA graphs: the mask is gathered from it inside the captured forward)."""
        self.ids = ids

    def _new_forward(self, module, args) -> None:
        self._mask = self.table.index_select(0, self.ids)

    def _rows_mask(self, n: int) -> torch.Tensor:
        """The mask for ``n`` flat tokens (each batch row's mask repeated over its positions)."""
        m = self._mask
        return m if n == m.shape[0] else m.repeat_interleave(n // m.shape[0], dim=0)

    # ---- forward -----------------------------------------------------------------------
    def _dense_hook(self, pair: _Pair):
        def hook(module, args, out):
            x = args[0]
            xa = F.linear(x, pair.a)
            if x.dim() == 3:
                xa = xa * self._mask[:, None, :]
            else:
                xa = xa * self._rows_mask(xa.shape[0])
            return out + F.linear(xa, pair.b)
        return hook

    def _experts_forward(self, moe: nn.Module, prefix: str):
        ex: StackedExperts = moe.experts
        pairs = {s: self.stacks[f"{prefix}.{s}"] for s in ex.stacks()}

        def project(x, stack, offs, mask):
            p = pairs[stack]
            return grouped(x, getattr(ex, stack), offs) + grouped(grouped(x, p.a, offs) * mask, p.b, offs)

        def routed_experts(flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            k, n = moe.top_k, flat.shape[0]
            expert_ids = idx.reshape(-1)
            order = expert_ids.argsort(stable=True)
            counts = torch.zeros(ex.num_local, dtype=torch.int64, device=flat.device).scatter_add_(
                0, expert_ids, torch.ones_like(expert_ids))
            offs = counts.cumsum(0).to(torch.int32)
            tok_of = order // k
            xs = flat.index_select(0, tok_of)
            mask = self._rows_mask(n).index_select(0, tok_of)
            if ex.gated:
                g, u = project(xs, "gate_up_proj", offs, mask).chunk(2, dim=-1)
                h = F.silu(g) * u
            else:
                h = F.relu(project(xs, "up_proj", offs, mask)).square()
            h = h * weights.reshape(-1).index_select(0, order)[:, None].to(h.dtype)
            y = project(h, "down_proj", offs, mask)
            return torch.zeros_like(flat).index_add_(0, tok_of, y.to(flat.dtype))
        return routed_experts

    # ---- loading -----------------------------------------------------------------------
    def load(self, adapter: Adapter, *, slot: int = 0, version: Optional[int] = None) -> None:
        """Copy ``adapter`` into ``slot`` (between engine steps: the caller holds the model lock) and
        verify the copy. Raises WeightLoadError,
        before anything is written, for a rank above the slots', a target the engine has no buffer
        for, or a mis-shaped factor."""
        if adapter.rank > self.rank:
            raise WeightLoadError(f"adapter rank {adapter.rank} > the engine's {self.rank} (trainer.lora.rank)")
        buffers = {**self.dense, **self.stacks}
        extra = sorted(set(adapter.tensors) - set(buffers))
        if extra:
            raise WeightLoadError(f"adapter targets {len(extra)} modules the engine has no LoRA buffers for "
                                  f"(trainer.lora.targets), e.g. {extra[:3]}")
        for t, (a, b) in adapter.tensors.items():
            p = buffers[t]
            want_a = (*p.a.shape[:-2], adapter.rank, p.a.shape[-1])
            want_b = (*p.b.shape[:-1], adapter.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise WeightLoadError(f"adapter {t}: A {tuple(a.shape)}, B {tuple(b.shape)}; the model needs "
                                      f"A {want_a}, B {want_b}")
        with torch.no_grad():
            for t, p in buffers.items():
                a, b = adapter.tensors.get(t, (None, None))
                p.put(slot, self.rank, a, b)
            bad = [t for t, (a, b) in adapter.tensors.items() if not buffers[t].holds(slot, self.rank, a, b)]
            row = self.table[slot]
            row.zero_()
            _block(row, 0, slot, self.rank).narrow(0, 0, adapter.rank).fill_(adapter.scale)
        if bad:  # the copy did not land (never expected: it is the check that makes delivery a fact)
            self.clear(slot)
            raise WeightLoadError(f"adapter copy into the engine's buffers did not hold for {bad[:3]}")
        self.versions[slot], self.held[slot] = version, (adapter.rank, adapter.scale, tuple(adapter.tensors))

    def held_adapter(self, slot: int = 0) -> Optional[Adapter]:
        """What slot ``slot`` holds, read back from the buffers (views), None when empty."""
        if self.held[slot] is None:
            return None
        rank, scale, targets = self.held[slot]
        buffers = {**self.dense, **self.stacks}
        tensors = {t: (_block(buffers[t].a, -2, slot, self.rank).narrow(-2, 0, rank),
                       _block(buffers[t].b, -1, slot, self.rank).narrow(-1, 0, rank)) for t in targets}
        return Adapter(tensors, rank=rank, alpha=scale * rank)

    def digest(self, slot: int = 0) -> Optional[str]:
        """The confirmation checksum of what slot ``slot`` SERVES: its buffers read back under the PEFT
        names, in the buffers' dtype (the trainer publishes in the inference dtype, so an adapter that
        arrived intact gives the trainer's digest; one that never landed gives another)."""
        adapter = self.held_adapter(slot)
        return None if adapter is None else adapter_files_digest(peft_state(adapter, None))

    def clear(self, slot: int) -> None:
        """Slot ``slot`` serves the base alone (zeros)."""
        with torch.no_grad():
            for p in [*self.dense.values(), *self.stacks.values()]:
                p.put(slot, self.rank, None, None)
            self.table[slot].zero_()
        self.versions[slot] = self.held[slot] = None


def read_step(step_dir) -> Adapter:
    """A published adapter step (workers/weights/lora_format.py); WeightLoadError naming the file for
    anything unreadable or non-finite."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from workers.weights.lora_format import CONFIG_FILE, WEIGHTS_FILE, from_peft_state

    step_dir = Path(step_dir)
    try:
        config = json.loads((step_dir / CONFIG_FILE).read_text())
        state = load_file(str(step_dir / WEIGHTS_FILE))
        adapter = Adapter(from_peft_state(state, config), rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                          base_model=config.get("base_model_name_or_path"))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise WeightLoadError(f"adapter step {step_dir} is unreadable: {type(e).__name__}: {str(e)[:300]}") from None
    bad = [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise WeightLoadError(f"adapter tensor {bad[0]} in {step_dir / WEIGHTS_FILE} holds NaN or inf")
    return adapter
