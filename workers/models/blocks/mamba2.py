"""The Mamba-2 mixer (selective state-space layer) of hybrid models, with a sequential reference scan.

The scan is the recurrence (state ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, output
``y_t = C_t h_t + D x_t``), run CHUNK tokens at a time in closed form (:func:`scan_chunk`, the SSD
form: an [L, L] decay-weighted product inside a chunk, the state carried between chunks) so a long
sequence is T / CHUNK steps, not T. ``scan(..., chunk=1)`` is the token-by-token recurrence (one
decode step is exactly that); tests check one against the other and both against transformers
(its chunked PyTorch path, equal up to float32 rounding). Fused kernels would go beside it.

What the layer does, in checkpoint names (Nemotron-H / Mamba-2: ``mixer.in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``):
1. ``in_proj`` splits into the gate z, the conv input xBC and the time step dt (one per head);
2. a depthwise causal conv1d (kernel ``conv_kernel``, with bias) over xBC, then SiLU;
3. xBC splits into x (heads x head_dim), B and C (``n_groups`` x ``ssm_state_size``; heads share
   their group's B and C); dt = softplus(dt + dt_bias), A = -exp(A_log);
4. the scan; 5. a grouped gated RMSNorm (``norm(y * silu(z))`` per group); 6. ``out_proj``.

Padding: pad tokens must leave the state untouched. As the reference does, the input is zeroed
at pads before ``in_proj`` and the conv output is zeroed at pads before the scan, so left pads
keep the state at zero and feed zeros to the conv window (what an unpadded sequence sees).

The time-step floor: the reference clamps dt at ``time_step_min`` in its multi-token path but
not in its one-token cached decode step; this layer does the same (``clamp_dt``), so the engine's
greedy tokens equal transformers' ``generate``. Where the floor binds, a cached decode step and a
full forward of the same sequence differ by exactly that clamp, in the reference as here.

Inference cache: ``(conv window [B, conv_dim, conv_kernel - 1], ssm state [B, H, head_dim, N]
float32)`` per layer (workers/models/blocks/cache.py ``states``), batch first, no time axis.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.blocks.mamba2_cp import forward_cp


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``y * silu(z)`` over groups of ``group_size`` channels (Mamba-2's ``norm``)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, eps: float, time_step_min: float, conv_bias: bool = True, proj_bias: bool = False):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba: num_heads({num_heads}) must be a multiple of n_groups({n_groups})")
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.conv_kernel, self.time_step_min = conv_kernel, time_step_min
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // n_groups, eps)
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=proj_bias)

    def empty_state(self, batch: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The state before any token: a zero conv window and a zero float32 SSM state."""
        return (torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, device=device, dtype=dtype),
                torch.zeros(batch, self.num_heads, self.head_dim, self.state_size, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, state: Optional[tuple] = None,
                return_state: bool = False, cp=None, *, right_pads: bool = False, decode: Optional[bool] = None):
        """``x`` [B, T, hidden]; ``valid`` [B, T] bool (pads False) or None; ``state`` the cached
        ``(conv window, ssm state)`` or None. Returns ``(y [B, T, hidden], new state or None)``.
        ``cp``: context parallel (this rank's chunk of the sequence; workers/models/blocks/mamba2_cp.py).
        ``right_pads`` (the static engine's chunked prefill: every row's valid tokens first): pads
        neither decay nor feed the state (dt = 0 there) and each row's conv window ends at its last
        valid token, so the returned state is each row's own after its valid tokens.
        ``decode``: whether this is a decode step (no dt floor); None: one cached token is one."""
        if cp is not None:
            return forward_cp(self, x, valid, cp), None
        b, t, _ = x.shape
        # One cached token is the reference's decode step: no padding mask, no dt floor.
        step = (state is not None and t == 1) if decode is None else decode
        mask = None if (valid is None or step) else valid[:, :, None].to(x.dtype)
        if mask is not None:
            x = x * mask
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        xbc, window = self._conv(xbc, None if state is None else state[0],
                                 valid.sum(1) if right_pads and mask is not None else None)
        if mask is not None:
            xbc = xbc * mask
        xs, bm, cm = xbc.split([self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        if not step:
            dt = dt.clamp(min=self.time_step_min)
        if right_pads and mask is not None:
            dt = dt * mask  # exp(0 * A) = 1 and 0 * B x = 0: a pad leaves the state as it was
        y, ssm = self.scan(xs.view(b, t, self.num_heads, self.head_dim), dt, bm.view(b, t, self.n_groups, -1),
                           cm.view(b, t, self.n_groups, -1), None if state is None else state[1])
        y = self.norm(y.reshape(b, t, self.inner), z)
        out = self.out_proj(y.to(x.dtype))
        return out, ((window, ssm) if return_state else None)

    def _conv(self, xbc: torch.Tensor, window: Optional[torch.Tensor], num_valid: Optional[torch.Tensor] = None):
        """Depthwise causal conv + SiLU over [B, T, C]; the window is the last ``conv_kernel - 1``
        inputs (zeros before the first token, as the conv's own left padding), or with
        ``num_valid`` [B] (right-padded rows) the ``conv_kernel - 1`` inputs before each row's pads."""
        u = xbc.transpose(1, 2)
        k = self.conv_kernel - 1
        full = F.pad(u, (k, 0)) if window is None else torch.cat([window.to(u.dtype), u], dim=-1)
        out = F.conv1d(full, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        if num_valid is None:
            return F.silu(out).transpose(1, 2), full[..., full.shape[-1] - k:]
        at = (num_valid[:, None] + torch.arange(k, device=u.device))[:, None, :].expand(-1, u.shape[1], k)
        return F.silu(out).transpose(1, 2), full.gather(-1, at)

    def scan(self, x: torch.Tensor, dt: torch.Tensor, bm: torch.Tensor, cm: torch.Tensor,
             h0: Optional[torch.Tensor], chunk: Optional[int] = None, heads: slice = slice(None)):
        """The recurrence in float32 over x [B,T,H,P], dt [B,T,H], B/C [B,T,G,N]; returns
        (y [B,T,H,P] float32, final state [B,H,P,N]). ``chunk`` (default :data:`CHUNK`) tokens at a
        time in closed form (:func:`scan_chunk`); ``chunk=1`` is the token-by-token recurrence.
        ``heads``: which of the layer's heads ``x`` holds (context parallel runs a slice of them)."""
        b, t, nh, p = x.shape
        rep = nh // bm.shape[2]
        x, dt = x.float(), dt.float()
        bm = bm.float().repeat_interleave(rep, dim=2)  # head j reads group j // rep
        cm = cm.float().repeat_interleave(rep, dim=2)
        log_decay = dt * -torch.exp(self.A_log[heads].float())  # [B, T, H]: log of exp(dt A)
        h = x.new_zeros(b, nh, p, self.state_size) if h0 is None else h0.float()
        xdt = x * dt[..., None]
        step = chunk or CHUNK
        ys = []
        for i in range(0, t, step):
            j = min(i + step, t)
            if j - i == 1:  # the recurrence itself (a decode step)
                h = h * log_decay[:, i, :, None, None].exp() + xdt[:, i, :, :, None] * bm[:, i, :, None, :]
                ys.append(torch.einsum("bhpn,bhn->bhp", h, cm[:, i])[:, None])
            else:
                y, h = scan_chunk(xdt[:, i:j], log_decay[:, i:j], bm[:, i:j], cm[:, i:j], h)
                ys.append(y)
        y = torch.cat(ys, dim=1) + x * self.D[heads].float()[:, None]
        return y, h


CHUNK = 64
"""Tokens per closed-form chunk of the scan: the loop runs T / CHUNK times, each chunk costs L^2."""


def scan_chunk(xdt: torch.Tensor, log_decay: torch.Tensor, bm: torch.Tensor, cm: torch.Tensor, h: torch.Tensor):
    """L tokens of the recurrence at once. With ``s_l`` the cumulative log decay up to token l,
    ``h_l = exp(s_l) h + sum_{k<=l} exp(s_l - s_k) B_k (dt x)_k`` and ``y_l = C_l . h_l``: an
    attention-like [L, L] product inside the chunk plus the carried state. Shapes: xdt [B,L,H,P],
    log_decay [B,L,H], B/C [B,L,H,N], h [B,H,P,N]; returns (y [B,L,H,P], state after the chunk)."""
    s = log_decay.cumsum(dim=1)  # [B, L, H]
    n = s.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    gaps = (s[:, :, None, :] - s[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    scores = torch.einsum("blhn,bkhn->blkh", cm, bm) * gaps.exp()  # [B, L(query), L(key), H]
    y = torch.einsum("blkh,bkhp->blhp", scores, xdt)
    y = y + torch.einsum("blhn,bhpn->blhp", cm, h) * s.exp()[..., None]
    to_end = (s[:, -1:, :] - s).exp()  # [B, L, H]: decay from each token to the chunk's end
    h = h * s[:, -1, :, None, None].exp() + torch.einsum("bkhn,bkhp->bhpn", bm * to_end[..., None], xdt)
    return y, h
