"""Trainer step with logits everywhere vs. only where they predict a loss token.

    python -m benchmarks.logits_selection [--rows 64] [--prompt 77] [--completion 6] [--repeats 3]

Why: an RL row is a long prompt plus a short completion, and only the completion's tokens are
scored, yet a plain forward computes ``[B, T, V]`` logits (and their softmax and gradient) at
every position. ``forward(..., logits_mask=...)`` (workers/models/tiny_moe/model.py, used by
workers/trainer/step.py) computes them only at the positions that predict a loss token.

Both variants run side by side in one process, alternating, on SmolLM2-135M's shape (random
init: no checkpoint needed), forward + log-probs + backward, float32; the table shows the
median seconds and the ratio. Writes benchmarks/out/logits_selection.json.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from workers.models.llama.convert import model_config_of
from workers.models.tiny_moe.model import TinyMoeForCausalLM
from workers.trainer.loss import loss_relevant_inputs, token_logprobs
from workers.trainer.step import scatter_logprobs
from workers.trainer.parallel.tensor import vocab_parallel_target_logprobs
from benchmarks.record import results_dir

RESULTS = results_dir()


def step_full(model, ids, loss_mask) -> float:
    t0 = time.perf_counter()
    logp, _ = token_logprobs(model(ids).logits, ids, 1.0)
    (logp * loss_mask).sum().backward()
    return time.perf_counter() - t0


class OneRank:
    """What ``step.scatter_logprobs`` needs of the trainer's model, for one rank (no process group)."""

    @staticmethod
    def target_logprobs(logits, targets, temperature):
        return vocab_parallel_target_logprobs(logits, targets, temperature, vocab_start=0, group=None)


def step_selected(model, ids, loss_mask) -> float:
    """The trainer's path (workers/trainer/step.py forward_rows): logits only where scored."""
    t0 = time.perf_counter()
    need = loss_relevant_inputs(loss_mask)
    logp, _ = scatter_logprobs(OneRank, model(ids, logits_mask=need).logits, ids, need, 1.0)
    (logp * loss_mask).sum().backward()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=77)
    p.add_argument("--completion", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = model_config_of("smollm2_135m")
    model = TinyMoeForCausalLM(cfg).init_weights(0)
    t = args.prompt + args.completion
    ids = torch.randint(0, cfg.vocab_size, (args.rows, t), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(args.rows, t, dtype=torch.bool)
    loss_mask[:, args.prompt:] = True
    times = {"full": [], "selected": []}
    step_selected(model, ids, loss_mask)  # warm-up (allocator, thread pool)
    for _ in range(args.repeats):
        for name, fn in (("full", step_full), ("selected", step_selected)):
            model.zero_grad(set_to_none=True)
            times[name].append(fn(model, ids, loss_mask))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"model": "smollm2_135m shape, random init, float32", "rows": args.rows, "prompt_tokens": args.prompt,
           "completion_tokens": args.completion, "threads": args.threads, "seconds": times, "median_s": med,
           "selected_over_full": med["selected"] / med["full"], "date": time.strftime("%Y-%m-%d")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "logits_selection.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"| logits | median s (fwd + log-probs + bwd, {args.rows} x ({args.prompt}+{args.completion}) tokens) |")
    print("|---|---|")
    for k in ("full", "selected"):
        print(f"| {k} | {med[k]:.2f} |")
    print(f"selected / full = {out['selected_over_full']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
