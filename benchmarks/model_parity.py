"""Every model family against transformers, side by side in one run: errors and training-step speed.

    python -m benchmarks.model_parity                 # CPU, tiny configs (writes benchmarks/out/model_parity.json)
    python -m benchmarks.model_parity --device cuda --size 1b --families qwen3_moe,deepseek_v3 \
        --out benchmarks/results/gpu/model_parity_h200.json   # the ~1B comparison on a GPU

For each family (its shapes: benchmarks/model_shapes.py): transformers' own model is built from
its config class (seeded, float32), saved with ``save_pretrained``; ours is configured from that
config.json (``from_hf_config``) and loads the checkpoint strictly. Measured: logits relative error and the worst per-parameter
gradient error (float32), then the training step (forward + backward of a token-mean loss +
AdamW step) of both models on the same batch in the compute dtype, interleaved so both see the
same machine state; reported as tokens/s and the ratio ours / transformers (> 1: ours faster).
On a GPU (or with ``--compile on``) a third model is timed: ours with every decoder layer
torch.compile-d as ``trainer.compile=layers`` does (workers/trainer/compile.py), with its own ratio
(``ratio_ours_compiled_over_hf``), and transformers' model with its decoder layers compiled the
same way (static shapes; ``ratio_ours_compiled_over_hf_compiled``; a compile failure is reported
in ``hf_compile_error``). CPU smoke of those columns:
``--families qwen3_moe --compile on --compile-backend aot_eager --iters 1 --out /tmp/mp.json``.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from workers.common.registry import MODELS
from benchmarks import model_shapes
from benchmarks.model_shapes import H200_BF16_PEAK
from benchmarks.record import results_dir


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def build_pair(family: str, model_type: str, kw: dict, tmp: Path, dtype: torch.dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.float32)
    hf.save_pretrained(tmp)
    spec = MODELS.get(family)
    cfg = spec.config(name=f"bench_{family}", path=str(tmp), **spec.from_hf_config(json.loads((tmp / "config.json").read_text())))
    ours = spec.init(cfg, torch.float32)
    return hf.to(device), ours.to(device), cfg


def grad_errors(hf, ours, ids: torch.Tensor) -> tuple[float, float]:
    """(logits relative error, worst per-parameter gradient relative error), float32, train mode off."""
    hf.eval(), ours.eval()
    out_hf = hf(input_ids=ids).logits
    out_ours = ours(ids).logits
    w = torch.linspace(-1, 1, out_hf.numel(), device=ids.device).view_as(out_hf)
    (out_hf * w).sum().backward()
    (out_ours * w).sum().backward()
    hf_grads = {}
    ours_params = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        if name in ours_params and ours_params[name].shape == p.shape:  # the same layout (GPT-OSS's experts too)
            hf_grads[name] = p.grad
        elif p.grad.dim() == 3 and name.endswith(("gate_up_proj", "down_proj", "up_proj")):  # fused experts
            kind = name.rsplit(".", 1)[1]
            pre = name[: -len(kind) - 1]
            for e in range(p.grad.shape[0]):
                g = p.grad[e]
                if kind == "gate_up_proj":
                    hf_grads[f"{pre}.{e}.gate_proj.weight"], hf_grads[f"{pre}.{e}.up_proj.weight"] = g.chunk(2)
                else:
                    hf_grads[f"{pre}.{e}.{kind}.weight"] = g
        else:
            hf_grads[name] = p.grad
    ours_grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    worst = max((rel_err(ours_grads[n], g) for n, g in hf_grads.items() if n in ours_grads and g.norm() > 0),
                default=float("nan"))
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    return rel_err(out_ours, out_hf), worst


HEAD_CHUNK = 4096
"""Positions per chunk of our fused log-prob head (trainer.logprob_chunk_tokens' default)."""


def _full_vocab_scorer(logits: torch.Tensor, targets: torch.Tensor):
    from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs

    return vocab_parallel_target_logprobs(logits, targets, 1.0, vocab_start=0, group=None)


HEADS = ("logits", "fused", "fused_loss")
"""Ours' loss: from [tokens, vocab] logits (as transformers), the fused log-prob head
(``trainer.logprob_head=fused``) or the loss-in-forward head (``fused_loss``)."""


def loss_of(model, ids: torch.Tensor, *, ours: bool, head: str = "logits") -> torch.Tensor:
    """Token-mean cross-entropy of next-token prediction. ``head`` (ours, :data:`HEADS`): ``fused``
    and ``fused_loss`` take the trainer's scoring path instead of logits (the same loss, no [tokens,
    vocab] tensor); ``fused_loss`` hands the head the per-token loss, as the trainer's one-pass step
    does (workers/trainer/head_loss.py), so its gradient is taken in the forward."""
    if ours and head != "logits":
        from workers.models.blocks.logprobs import Scoring

        need = torch.ones_like(ids, dtype=torch.bool)
        need[:, -1] = False
        n = ids.numel() - ids.shape[0]  # every position but each row's last (no device read)
        token_loss = (lambda lp, a, b: -lp.sum() / n) if head == "fused_loss" else None
        score = Scoring(targets=ids[:, 1:].reshape(-1), scorer=_full_vocab_scorer, chunk_tokens=HEAD_CHUNK,
                        fused_temperature=1.0, token_loss=token_loss)
        out = model(ids, logits_mask=need, score=score)
        return out.head_loss if out.head_loss is not None else -out.logp.mean()
    logits = model(ids).logits if ours else model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def train_step(model, ids: torch.Tensor, opt, *, ours: bool, head: str = "logits") -> None:
    """One step: :func:`loss_of`, backward, AdamW."""
    loss_of(model, ids, ours=ours, head=head).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def adamw(params, fused: bool) -> torch.optim.Optimizer:
    """The benchmark's optimizer, the same on both sides: ``fused`` is what both projects build on CUDA
    (our ``build_optimizer``; transformers' ``TrainingArguments.optim`` default ``adamw_torch_fused``)."""
    return torch.optim.AdamW(params, lr=1e-6, **({"fused": True} if fused else {}))


def time_steps(models: dict[str, torch.nn.Module], ids: torch.Tensor, dtype: torch.dtype,
               iters: int, head: str = "logits", fused_adamw: bool = False) -> dict[str, float]:
    """Seconds per training step (median) of each model, interleaved: ours, transformers, ours compiled,
    ours, ... (names starting with ``ours`` are ours). The 2 warm-up rounds include compiling."""
    models = {name: m.to(dtype).train() for name, m in models.items()}
    opts = {name: adamw(m.parameters(), fused_adamw) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    for i in range(iters + 2):
        for name, model in models.items():
            sync()
            t0 = time.perf_counter()
            train_step(model, ids, opts[name], ours=name.startswith("ours"), head=head)
            sync()
            if i >= 2:  # warm-up: allocator, kernels, optimizer state, torch.compile
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(xs)[len(xs) // 2] for name, xs in times.items()}


def compiled_copy(ours: torch.nn.Module, backend: str) -> torch.nn.Module:
    """A copy of ours with every decoder layer compiled as the trainer's ``trainer.compile=layers`` does."""
    from workers.trainer.compile import apply_compile

    twin = copy.deepcopy(ours)
    apply_compile(twin.model.layers, "layers", backend=backend)
    return twin


def hf_compiled_copy(hf: torch.nn.Module, backend: str, ids: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.nn.Module | None, str | None]:
    """A copy of transformers' model with every decoder layer ``torch.compile``-d (static shapes: the
    benchmark's one batch shape, which favours it), tried on one step first: (model, None), or
    (None, the error) when compiling fails, so the eager columns still come out."""
    twin = copy.deepcopy(hf)
    for layer in twin.model.layers:
        layer.compile(backend=backend)
    try:
        train_step(twin.to(dtype).train(), ids, torch.optim.AdamW(twin.parameters(), lr=0.0), ours=False)
    except Exception as e:  # noqa: BLE001 (any compile failure is reported, not raised)
        return None, f"{type(e).__name__}: {e}".splitlines()[0]
    twin.zero_grad(set_to_none=True)
    return twin, None


def run(families: list[str], *, size: str, device: str, dtype: torch.dtype, batch: int, seq: int, iters: int,
        compile_backend: str | None = None, head: str = "logits", fused_adamw: bool = False) -> dict:
    """``compile_backend`` (None: no compiled column): also time ours with compiled layers.
    ``head`` (:data:`HEADS`): where ours' loss comes from; ``fused_adamw``: both sides' AdamW fused."""
    configs = {"1b": model_shapes.gpu_configs, "real": model_shapes.real_configs}.get(size, model_shapes.tiny_configs)()
    rows = []
    for family in families:
        model_type, kw = configs[family]
        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # GB-sized checkpoints: memory, not a slow disk
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            hf, ours, cfg = build_pair(family, model_type, kw, Path(tmp), dtype, device)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, kw["vocab_size"], (batch, seq), generator=gen).to(device)
        small = ids[:, : min(seq, 64)]
        logits_err, grad_err = grad_errors(hf, ours, small) if size == "tiny" else (float("nan"), float("nan"))
        models = {"ours": ours, "hf": hf}
        hf_compile_error = None
        if compile_backend:
            models["ours_compiled"] = compiled_copy(ours, compile_backend)
            models["hf_compiled"], hf_compile_error = hf_compiled_copy(hf, compile_backend, ids, dtype)
            if models["hf_compiled"] is None:
                del models["hf_compiled"]
        secs = time_steps(models, ids, dtype, iters, head=head, fused_adamw=fused_adamw)
        ours_s, hf_s = secs["ours"], secs["hf"]
        tokens = batch * seq
        flops = model_shapes.train_flops_per_token(ours, kw, seq) * tokens
        row = {"family": family, "shape": size, "ours_head": head, "adamw": "fused" if fused_adamw else "foreach",
               "vocab_size": kw["vocab_size"], "num_experts": kw.get("num_experts") or kw.get("n_routed_experts"),
               "top_k": kw.get("num_experts_per_tok"), "train_flops_per_step": flops,
               "mfu_ours": flops / ours_s / H200_BF16_PEAK, "mfu_hf": flops / hf_s / H200_BF16_PEAK,
               "params": sum(p.numel() for p in ours.parameters()), "tokens_per_step": tokens,
               "logits_rel_err": logits_err, "grad_rel_err_max": grad_err, "ours_tokens_per_s": tokens / ours_s,
               "hf_tokens_per_s": tokens / hf_s, "ratio_ours_over_hf": hf_s / ours_s}
        line = ""
        if "ours_compiled" in secs:
            row.update(ours_compiled_tokens_per_s=tokens / secs["ours_compiled"], compile_backend=compile_backend,
                       ratio_ours_compiled_over_hf=hf_s / secs["ours_compiled"],
                       mfu_ours_compiled=flops / secs["ours_compiled"] / H200_BF16_PEAK)
            line = (f"  compiled {row['ours_compiled_tokens_per_s']:9.0f} tok/s  "
                    f"ratio {row['ratio_ours_compiled_over_hf']:.2f}")
        if "hf_compiled" in secs:
            row.update(hf_compiled_tokens_per_s=tokens / secs["hf_compiled"],
                       mfu_hf_compiled=flops / secs["hf_compiled"] / H200_BF16_PEAK,
                       ratio_ours_compiled_over_hf_compiled=secs["hf_compiled"] / secs["ours_compiled"])
            line += (f"  transformers compiled {row['hf_compiled_tokens_per_s']:9.0f} tok/s  "
                     f"ratio {row['ratio_ours_compiled_over_hf_compiled']:.2f}")
        elif hf_compile_error:
            row["hf_compile_error"] = hf_compile_error
            line += f"  transformers compiled: failed ({hf_compile_error[:80]})"
        rows.append(row)
        print(f"{family:12s} params {row['params']:>13,d}  logits err {logits_err:.1e}  grad err {grad_err:.1e}  "
              f"step ours {tokens / ours_s:9.0f} tok/s  transformers {tokens / hf_s:9.0f} tok/s  "
              f"ratio {row['ratio_ours_over_hf']:.2f}{line}", flush=True)
        del hf, ours, models
    return {"device": device if device == "cpu" else torch.cuda.get_device_name(), "dtype": str(dtype),
            "batch": batch, "seq_len": seq, "size": size, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(model_shapes.tiny_configs()))
    ap.add_argument("--size", choices=("tiny", "1b", "real"), default="tiny",
                    help="real: 128 experts top-8, 152k / 164k vocabularies (qwen3_moe, deepseek_v3); Qwen3-8B's dense "
                         "layer (qwen3); GPT-OSS-20B's MoE layer (gpt_oss)")
    ap.add_argument("--ours-head", choices=("auto",) + HEADS, default="auto",
                    help="ours' loss from logits, the fused log-prob head or the loss-in-forward head (the "
                         "trainer's paths); auto: fused_loss at --size real, else logits")
    ap.add_argument("--adamw", choices=("auto", "foreach", "fused"), default="auto",
                    help="both sides' AdamW; auto: fused on a CUDA device (both projects' CUDA default)")
    ap.add_argument("--toy", action="store_true", help="with --size real: same keys, widths cut for a CPU smoke run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=str(results_dir() / "model_parity.json"))
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="also time ours with compiled layers (trainer.compile=layers); auto: on a CUDA device")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: CPU smoke)")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    compiled = a.compile == "on" or (a.compile == "auto" and a.device.startswith("cuda"))
    head = a.ours_head if a.ours_head != "auto" else ("fused_loss" if a.size == "real" else "logits")
    fused_adamw = a.adamw == "fused" or (a.adamw == "auto" and a.device.startswith("cuda"))
    if a.toy:
        model_shapes.shrink_real_configs()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in a.families.split(","):  # written after each family: a time limit keeps the finished rows
        result = run([family], size=a.size, device=a.device, dtype=getattr(torch, a.dtype), batch=a.batch,
                     seq=a.seq, iters=a.iters, compile_backend=a.compile_backend if compiled else None,
                     head=head, fused_adamw=fused_adamw)
        rows += result["rows"]
        Path(a.out).write_text(json.dumps({**result, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
