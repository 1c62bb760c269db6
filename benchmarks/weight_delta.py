"""Sparse weight deltas on real training (issue 31): how much of a bf16 publish changes per step, and
whether receivers of patches end bit-identical to a dense publish.

    python -m benchmarks.weight_delta [--out FILE] [--steps 60] [--lr 1e-6] [--record]

Trains one model on the CPU with fp32 master weights and AdamW (SmolLM2-135M when ``make
install-pretrained`` prepared it, else the tiny MoE: said in the JSON as ``model``) on a task it
learns (next-token loss on reversed digit strings; the loss is printed), publishing every step in
bf16 through the filesystem transport with ``weights.delta`` (the PatchPublisher the trainer uses:
anchor every ``--full-every`` steps, patches between). Two receivers follow, as engines do: one
applies every version as it comes; one is "respawned" at the middle step (a fresh model: anchor +
every patch after it). Per step: changed fraction of the published elements, patch bytes vs the
dense bytes of the same step, seconds the trainer was blocked. JSON keys:
``bytes_ratio_delta_over_dense`` (median over patch steps; target <= 0.10) and ``bit_exact``
(both receivers' every tensor equal to a dense publish of the same weights, after every step).
Writes FILE (default benchmarks/out/weight_delta.json; ``--record``: benchmarks/results/, benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.record import results_dir
from workers.common.protocol import step_name
from workers.common.registry import MODELS
from workers.trainer.weight_stream import ModelWeights
from workers.weights.base import SoloPeers
from workers.weights.checksums import state_hashes
from workers.weights.delta.apply import apply_chain
from workers.weights.filesystem.layout import INDEX
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.filesystem.receiver import DiskReader



def compose_model(prefer_smollm2: bool):
    """The model section: SmolLM2-135M when prepared (and asked for), else the tiny MoE."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from launcher.config_store import register

    register()
    name = "tiny_moe"
    if prefer_smollm2:
        from workers.models.pretrained import default_dir, is_prepared

        if is_prepared("smollm2_135m", default_dir("smollm2_135m")):
            name = "smollm2_135m"
    with initialize_config_module("hydra_conf", version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=[f"model={name}"]))
    if name != "tiny_moe":
        from launcher.pretrained import ensure_converted, pin_pretrained_dir

        cfg = pin_pretrained_dir(cfg)
        ensure_converted(cfg)
    return cfg, name


def batch(vocab: int, seq: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Digit strings followed by their reverse: a task the model can learn (loss on every next token)."""
    half = seq // 2
    x = torch.randint(4, min(vocab, 14), (rows, half), generator=gen)
    return torch.cat([x, x.flip(1)], dim=1)


class Receiver:
    """An engine's side: a bf16 copy of the model (HF names) and the sums the reader hands back."""

    def __init__(self, spec, model_cfg):
        self.model = spec.build(model_cfg).to(torch.bfloat16)
        names = spec.to_hf({n: n for n in self.model.state_dict()})
        own = self.model.state_dict()
        self.params = {hf: own[n] for hf, n in names.items()}
        self.sums = None
        self.reader = DiskReader()

    def load(self, step_dir: Path) -> None:
        got = self.reader.load(step_dir, None, None, self.sums)
        if got.patches:
            self.sums = apply_chain(self.params, got.patches, got.sums)
        else:
            with torch.no_grad():
                for n, t in got.state.items():
                    self.params[n].copy_(t)
            self.sums = got.sums


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(results_dir() / "weight_delta.json"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--full-every", type=int, default=20)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE even when SmolLM2 is prepared")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg, name = compose_model(not args.tiny)
    spec = MODELS.get(cfg.model.family)
    model = spec.init(cfg.model, torch.float32)  # fp32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    root = Path(tempfile.mkdtemp(prefix="weight_delta_"))
    pub = PatchPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=args.full_every + 2),
                         full_every=args.full_every)
    steady, respawned = Receiver(spec, cfg.model), None
    gen = torch.Generator().manual_seed(1)
    seq = min(32, cfg.model.max_position_embeddings)
    rows, exact = [], True
    try:
        for step in range(args.steps + 1):
            loss = None
            if step:
                x = batch(cfg.model.vocab_size, seq, args.rows, gen)
                out = model(x[:, :-1])
                logits = getattr(out, "logits", out)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
            weights = ModelWeights(model, dtype=torch.bfloat16, to_hf=spec.to_hf)
            stats = pub.publish(step, weights).metrics()
            pub.flush()
            dense = {n: t for n, t in weights.items()}  # what a dense publish of this version sends
            index = json.loads((root / step_name(step) / INDEX).read_text())
            steady.load(root / step_name(step))
            if step == args.steps // 2:
                respawned = Receiver(spec, cfg.model)  # a worker respawned mid-run: anchor + patches
            if respawned is not None:
                respawned.load(root / step_name(step))
            want = state_hashes(dense)
            ok = state_hashes(steady.params) == want and (respawned is None or state_hashes(respawned.params) == want)
            exact &= ok
            st = index.get("stats")
            row = {"step": step, "loss": None if loss is None else float(loss.detach()), "anchor": st is None,
                   "changed_frac": None if st is None else st["changed"] / st["compared"],
                   "delta_bytes": None if st is None else st["bytes"], "dense_bytes": weights.nbytes,
                   "blocked_s": stats["weight_blocked_s"], "bit_exact": ok}
            rows.append(row)
            if step % 10 == 0 or not ok:
                frac = "anchor" if st is None else f"changed {row['changed_frac']:.4f} bytes {st['bytes'] / weights.nbytes:.4f}"
                print(f"[weight_delta] step {step:3d} loss {row['loss'] or float('nan'):.4f} {frac} "
                      f"blocked {row['blocked_s'] * 1e3:.1f} ms exact {ok}", flush=True)
    finally:
        pub.close()
        shutil.rmtree(root, ignore_errors=True)
    patch_rows = [r for r in rows if not r["anchor"]]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "python -m benchmarks.weight_delta",
              "device": "cpu", "model": name, "num_parameters": sum(p.numel() for p in model.parameters()),
              "lr": args.lr, "master_dtype": "float32", "published_dtype": "bfloat16", "steps": args.steps,
              "full_every": args.full_every, "num_updates": len(rows) - 1,
              "bytes_ratio_delta_over_dense": statistics.median(r["delta_bytes"] / r["dense_bytes"] for r in patch_rows),
              "changed_frac_median": statistics.median(r["changed_frac"] for r in patch_rows),
              "bit_exact": exact, "respawned_at_step": args.steps // 2,
              "loss_first": rows[1]["loss"], "loss_last": rows[-1]["loss"], "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"[weight_delta] {name}: median changed fraction {result['changed_frac_median']:.4f}, bytes delta/dense "
          f"{result['bytes_ratio_delta_over_dense']:.4f} (target <= 0.10), bit_exact {exact}, loss "
          f"{result['loss_first']:.4f} -> {result['loss_last']:.4f}; wrote {out}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
