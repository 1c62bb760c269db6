"""``python -m benchmarks.sglang_delta_apply``: what applying one sparse patch costs one SGLang server rank.

Why: the known trap of delta updates into SGLang is the apply, not the wire (a delta path that applied
expert tensors one at a time took ~1 min per update). This runs the server side of our patch loader
(workers/weights/sglang/patch_loader.apply_patch: decode + map every HF expert tensor to its
FusedMoE slot + sum64-verified batched in-place apply) on one rank's share of a MoE model in SGLang's
layout: ``--layers`` blocks of fused ``w13_weight [E_local, 2I, H]`` / ``w2_weight [E_local, H, I]``
(bf16, on ``--device``), with a patch touching ``--fraction`` of every expert tensor's elements at random
positions. Reported per patch: payload MB, seconds to decode (checksums included), seconds to apply, and
the changed elements per second; the first patch also computes every touched tensor's digest once (the
loader does that after each full load), the second shows the steady state.

CPU (small): ``python -m benchmarks.sglang_delta_apply`` (-> benchmarks/out/; ``--record``: the tracked
benchmarks/results/, benchmarks/record.py). GPU, a GLM-5 decode rank's expert shapes
(H 6144, I 2048, 8 local experts; 20 of its ~75 MoE layers, ~23 GB):
``python -m benchmarks.sglang_delta_apply --device cuda --layers 20 --experts 8 --hidden 6144
--intermediate 2048 --fraction 0.011 --out benchmarks/results/gpu/sglang_delta_apply.json``.
Needs only torch, numpy, safetensors and xxhash (no sglang). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.record import results_dir
from workers.weights.broadcast.delta_wire import patch_payload
from workers.weights.sglang.patch_loader import apply_patch
from workers.weights.delta.patch import Part
from workers.weights.delta.sum64 import tensor_sum64


class FusedExperts(nn.Module):
    """One rank's FusedMoE parameters and its global -> local expert map (EP rank 0)."""

    def __init__(self, experts: int, hidden: int, inter: int, device: str):
        super().__init__()
        self.moe_tp_size, self.layer_id, self.num_local = 1, 0, experts
        self.w13_weight = nn.Parameter(torch.randn(experts, 2 * inter, hidden, device=device).to(torch.bfloat16),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.randn(experts, hidden, inter, device=device).to(torch.bfloat16),
                                      requires_grad=False)

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return expert_id if expert_id < self.num_local else -1


def build(args) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    layers = nn.ModuleList()
    for _ in range(args.layers):
        block = nn.Module()
        block.mlp = nn.Module()
        block.mlp.experts = FusedExperts(args.experts, args.hidden, args.intermediate, args.device)
        layers.append(block)
    model.model.layers = layers
    return model


def hf_views(model, args) -> dict[str, torch.Tensor]:
    out = {}
    for li, block in enumerate(model.model.layers):
        m = block.mlp.experts
        for e in range(args.experts):
            x = f"model.layers.{li}.mlp.experts.{e}"
            out[f"{x}.gate_proj.weight"] = m.w13_weight.data[e, :args.intermediate]
            out[f"{x}.up_proj.weight"] = m.w13_weight.data[e, args.intermediate:]
            out[f"{x}.down_proj.weight"] = m.w2_weight.data[e]
    return out


def make_patch(views, sums, fraction: float, seed: int):
    """A patch moving ``fraction`` of every tensor (new values: the old + a random bf16 step) and the
    digests after it (computed on a copy, as the trainer's tracker knows them)."""
    g = torch.Generator().manual_seed(seed)
    parts, after = {}, {}
    for name, v in views.items():
        n = v.numel()
        pos = torch.unique(torch.randint(0, n, (max(1, int(fraction * n)),), generator=g))
        old = v.reshape(-1)[pos.to(v.device)].cpu()
        new = (old.float() + torch.randn(pos.numel(), generator=g) * 0.05).to(torch.bfloat16)
        parts[name] = [Part(pos, new)]
        flat = v.reshape(-1).clone()
        flat[pos.to(v.device)] = new.to(v.device)
        after[name] = tensor_sum64(flat)
        sums[name] = after[name]
    return parts, after


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--fraction", type=float, default=0.011)
    ap.add_argument("--out", default=str(results_dir() / "sglang_delta_apply.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = build(args)
    views = hf_views(model, args)
    shapes = {n: list(v.shape) for n, v in views.items()}
    dtypes = {n: "bfloat16" for n in views}
    numels = {n: v.numel() for n, v in views.items()}
    sums: dict[str, int] = {}
    rows = []
    for k in (1, 2):
        parts, after = make_patch(views, sums, args.fraction, k)
        raw, mlen = patch_payload(parts, after, numels, dtypes)
        desc = {"version": k, "anchor": 0, "manifest_bytes": mlen, "shapes": shapes}
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            changed = apply_patch(model, desc, raw, copies=lambda m, e: [e])
        sync()
        seconds = time.perf_counter() - t0
        ok = all(tensor_sum64(v) == after[n] for n, v in views.items())
        rows.append({"patch": k, "payload_mb": len(raw) / 1e6, "changed": changed, "apply_s": seconds,
                     "changed_per_s": changed / seconds, "bit_exact": ok,
                     "note": "first patch: every touched tensor's digest computed once" if k == 1 else "steady"})
    params = sum(v.numel() for v in views.values())
    result = {"device": args.device, "layers": args.layers, "experts_per_rank": args.experts, "hidden": args.hidden,
              "intermediate": args.intermediate, "fraction": args.fraction, "rank_params": params,
              "rank_gb_bf16": params * 2 / 1e9, "patches": rows}
    print(f"{'patch':>5} {'payload MB':>11} {'changed':>12} {'apply s':>9} {'Melem/s':>9} exact")
    for r in rows:
        print(f"{r['patch']:>5} {r['payload_mb']:>11.1f} {r['changed']:>12,} {r['apply_s']:>9.3f} "
              f"{r['changed_per_s'] / 1e6:>9.1f} {r['bit_exact']}  ({r['note']})")
    print(f"one rank: {args.layers} layers x {args.experts} experts, {params / 1e9:.2f}B params "
          f"({params * 2 / 1e9:.1f} GB bf16) on {args.device}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
