"""The Mamba-2 mixer under context parallelism: this rank's tokens in, the scan over the whole
sequence for this rank's heads (workers/models/blocks/ulysses.py explains the layout).

The recurrence is per head (each head has its own state, ``A``, ``D``, ``dt``), so a head split is
exact, as for attention. The order of work on a rank (sequence chunk ``t = T/cp``, ``H`` heads):

1. per token, all heads: zero the pads, ``in_proj`` -> z, xBC, dt; ``dt = softplus(dt + dt_bias)``
   with the floor (a multi-token forward, as the one-rank path);
2. all-to-all: x ``[B, t, H, P]`` -> ``[B, T, H/cp, P]``, dt likewise, B/C by group (groups
   repeated by :func:`spread_groups` when cp does not divide ``n_groups``);
3. the depthwise causal conv1d over the WHOLE sequence, on the conv channels of this rank's heads
   and groups only (a depthwise conv is per channel: the weight rows are picked, not split), SiLU,
   pads zeroed with the whole-sequence valid mask;
4. the scan over this rank's heads (``A_log`` / ``D`` rows of those heads);
5. the inverse all-to-all of y, then per token again: the gated RMSNorm (its groups span heads of
   other ranks, so it runs after y is back on its tokens, with all heads) and ``out_proj``.

Gradients of the picked conv rows, A_log, D and dt_bias rows reach the full parameters; the other
ranks' picks fill the rest, and the data-parallel gradient sum adds them up.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.models.blocks.ulysses import SeqShard, heads_to_seq, seq_to_heads, spread_groups


def forward_cp(mixer, x: torch.Tensor, valid: torch.Tensor, cp: SeqShard) -> torch.Tensor:
    """``x`` [B, t, hidden] (this rank's tokens), ``valid`` [B, t]; returns y [B, t, hidden]."""
    b, t, _ = x.shape
    nh, p, ng, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.state_size
    x = x * valid[:, :, None].to(x.dtype)
    z, xbc, dt = mixer.in_proj(x).split([mixer.inner, mixer.conv_dim, nh], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias).clamp(min=mixer.time_step_min)
    xs, bm, cm = xbc.split([mixer.inner, ng * n, ng * n], dim=-1)
    bm, groups = spread_groups(bm.view(b, t, ng, n), ng, nh, cp.size, dim=2)
    cm, _ = spread_groups(cm.view(b, t, ng, n), ng, nh, cp.size, dim=2)
    xs = seq_to_heads(xs.view(b, t, nh, p), cp, head_dim=2, seq_dim=1)  # [B, T, H/cp, P]
    bm, cm = (seq_to_heads(m, cp, head_dim=2, seq_dim=1) for m in (bm, cm))  # [B, T, groups/cp, N]
    dt = seq_to_heads(dt, cp, head_dim=2, seq_dim=1)  # [B, T, H/cp]
    seq = xs.shape[1]
    u = torch.cat([xs.flatten(2), bm.flatten(2), cm.flatten(2)], dim=-1)  # this rank's conv channels
    rows = conv_channels(mixer, cp, groups, x.device)
    k = mixer.conv_kernel - 1
    bias = None if mixer.conv1d.bias is None else mixer.conv1d.bias[rows]
    u = F.conv1d(F.pad(u.transpose(1, 2), (k, 0)), mixer.conv1d.weight[rows], bias, groups=len(rows))
    u = F.silu(u).transpose(1, 2) * cp.valid[:, :, None].to(u.dtype)
    hl, gl = nh // cp.size, groups // cp.size
    xs, bm, cm = u.split([hl * p, gl * n, gl * n], dim=-1)
    heads = slice(cp.rank * hl, (cp.rank + 1) * hl)
    y, _ = mixer.scan(xs.view(b, seq, hl, p), dt, bm.view(b, seq, gl, n), cm.view(b, seq, gl, n), None, heads=heads)
    y = heads_to_seq(y, cp, head_dim=2, seq_dim=1)  # [B, t, H, P] float32
    y = mixer.norm(y.reshape(b, t, mixer.inner), z)
    return mixer.out_proj(y.to(x.dtype))


def conv_channels(mixer, cp: SeqShard, groups: int, device) -> torch.Tensor:
    """Indices of ``conv1d``'s channels this rank convolves, in the order of its all-to-all'ed input:
    its heads' x channels, then the B and C channels of its (possibly repeated) groups."""
    p, n, ng = mixer.head_dim, mixer.state_size, mixer.n_groups
    hl, gl = mixer.num_heads // cp.size, groups // cp.size
    x_rows = torch.arange(cp.rank * hl * p, (cp.rank + 1) * hl * p, device=device)
    spread = torch.arange(cp.rank * gl, (cp.rank + 1) * gl, device=device)
    original = spread // (groups // ng)  # spread_groups repeats group g as g*rep .. g*rep + rep - 1
    b_rows = (mixer.inner + original[:, None] * n + torch.arange(n, device=device)).flatten()
    return torch.cat([x_rows, b_rows, b_rows + ng * n])
