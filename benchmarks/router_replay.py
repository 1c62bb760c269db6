"""Router Replay benchmark: how much train/inference mismatch KL does R3 remove? (issue 5)

    python -m benchmarks.router_replay                      # both models, seeded init weights
    python -m benchmarks.router_replay --weights RUN/weights/step_000100   # + trained tiny_moe

Method, every piece the production one:
1. One fp32 master per model (the seeded init the RL run starts from, or a published
   weights/step_N). The embedded InferenceEngine (workers/inference/embedded/engine.py) holds a bf16
   copy and samples completions of reverse_digits prompts at temperature 1 with
   ``return_routed_experts`` (continuous batching, KV cache: the real inference path).
2. The samples become a trainer batch through the orchestrator's batch writer and the
   trainer's loader (rollouts/step_0 in a temp dir: binary routed experts, routed_mask).
3. The trainer's own forward (workers/trainer/step.py ``forward_rows``, sharded model at
   tp = ep = 1) scores the same tokens in fp32 (the issue's setting) and in bf16 (same
   dtype as inference: what is left is kernel order and the routing flips it causes),
   without and with Router Replay.
4. ``kl`` = mean k3 over completion tokens, the trainer's ``mismatch_kl`` (loss.policy_loss);
   ``routing_disagreement`` = (token, layer) slots whose expert set differs between trainer
   (no replay) and inference; ``kl_reduction = kl_no_replay / kl_replay``.
Writes benchmarks/out/router_replay.json; ``summary.kl_reduction`` is tiny_moe, seeded
init, fp32 trainer. The target is >= 10; the result is reported whatever it is.
``--record`` writes into the tracked benchmarks/results/ instead (benchmarks/record.py).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from workers.common.protocol import RunPaths
from workers.inference.embedded.engine import GenRequest, InferenceEngine
from workers.models.tiny_moe.model import TinyMoeConfig, TinyMoeForCausalLM, build_model, num_parameters
from workers.orchestrator.batch_builder import write_batch
from workers.orchestrator.buffer import RolloutGroup, Sample
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig, ReverseDigitsEnv
from workers.trainer.batch import RolloutBatch, load_batch
from workers.trainer.loss import loss_relevant_inputs, policy_loss, routing_disagreement
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.parallel.fsdp import FsdpTrainerModel, unsharded
from workers.trainer.step import forward_rows
from benchmarks.record import results_dir

RESULTS = results_dir() / "router_replay.json"
MODELS = {  # hydra_conf/model/tiny_moe.yaml, and 2x the depth and width with 4x the experts (top-4): 27M params, 8x
    "tiny_moe": TinyMoeConfig(vocab_size=16, hidden_size=128, num_layers=4, num_heads=4, num_experts=8, top_k=2,
                              expert_intermediate_size=256, max_position_embeddings=64),
    "larger_moe": TinyMoeConfig(vocab_size=16, hidden_size=256, num_layers=8, num_heads=8, num_experts=32, top_k=4,
                                expert_intermediate_size=128, max_position_embeddings=64),
}
SEED = 1234
ONE = ParallelDims(rank=0, world_size=1, dp=1, backend="gloo", device=torch.device("cpu"))


def sample(master: TinyMoeForCausalLM, *, num_prompts: int, new_tokens: int, seed: int) -> tuple[RolloutBatch, float]:
    """bf16 engine rollouts -> the trainer's batch, via the orchestrator writer and trainer loader."""
    cfg = master.config
    engine_model = TinyMoeForCausalLM(cfg).to(torch.bfloat16)
    engine_model.load_state_dict(master.state_dict())  # rounds the fp32 master to bf16, as a weight update does
    env = ReverseDigitsEnv(ReverseDigitsConfig(min_digits=3, max_digits=8), seed=seed)
    tasks = [env.sample_task() for _ in range(num_prompts)]
    # No stop token: every sample has new_tokens tokens, so both models are scored on as many.
    reqs = [GenRequest(input_ids=list(t.prompt_ids), temperature=1.0, max_new_tokens=new_tokens,
                       return_routed_experts=True) for t in tasks]
    engine = InferenceEngine(engine_model, max_batch_size=64, seed=seed).start()
    t0 = time.perf_counter()
    try:
        outs = engine.generate(reqs, timeout_s=900)
    finally:
        engine.shutdown()
    wall = time.perf_counter() - t0
    routed_dtype = np.uint8 if cfg.num_experts <= 256 else np.uint16
    groups = [RolloutGroup(group_id=i, task_id=t.task_id, samples=[Sample(
        prompt_ids=list(t.prompt_ids), completion_ids=o.output_ids, completion_logprobs=o.logprobs,
        token_versions=o.token_versions, reward=0.0, finish_reason=o.finish_reason["type"],
        routed_experts=o.routed_experts.numpy().astype(routed_dtype))]) for i, (t, o) in enumerate(zip(tasks, outs))]
    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(tmp)
        write_batch(paths, 0, groups, num_layers=cfg.num_layers, top_k=cfg.top_k, temperature=1.0, extra_metrics={})
        batch = load_batch(paths.rollouts(0), step=0, num_layers=cfg.num_layers, top_k=cfg.top_k,
                           num_experts=cfg.num_experts)
    return batch, wall


@torch.no_grad()
def score(trainer: FsdpTrainerModel, batch: RolloutBatch, *, replay: bool) -> dict:
    fwd = forward_rows(trainer, batch, replay=replay, pack=False)
    lm = batch.loss_mask
    _, st = policy_loss(fwd.logp.float(), batch.inference_logprobs, torch.zeros(batch.num_rows), lm,
                        num_loss_tokens=float(lm.sum()), ratio_cap=2.0, ratio_mask_low=0.2, ratio_mask_high=5.0)
    d, s = routing_disagreement(fwd.own, batch.routed_experts, loss_relevant_inputs(lm) & batch.routed_mask)
    return {"kl": st.k3_sum / st.num_tokens, "routing_disagreement": d / s, "ratio_min": st.ratio_min,
            "ratio_max": st.ratio_max, "num_tokens": int(st.num_tokens)}


def measure(name: str, weights: str, master: TinyMoeForCausalLM, args) -> list[dict]:
    batch, wall = sample(master, num_prompts=args.num_prompts, new_tokens=args.new_tokens, seed=args.seed)
    rows = []
    for dtype in ("float32", "bfloat16"):
        full = TinyMoeForCausalLM(master.config).to(getattr(torch, dtype))
        full.load_state_dict(master.state_dict())
        trainer = unsharded(full, ONE).eval()
        no, yes = score(trainer, batch, replay=False), score(trainer, batch, replay=True)
        rows.append({"model": name, "weights": weights, "params_m": num_parameters(master.config) / 1e6,
                     "trainer_dtype": dtype, "inference_dtype": "bfloat16", "num_tokens": no["num_tokens"],
                     "kl_no_replay": no["kl"], "kl_replay": yes["kl"],
                     "routing_disagreement": no["routing_disagreement"],
                     "routing_disagreement_per_layer_replay": yes["routing_disagreement"],
                     "kl_reduction": no["kl"] / yes["kl"] if yes["kl"] > 0 else float("inf"),
                     "ratio_range_no_replay": [no["ratio_min"], no["ratio_max"]],
                     "ratio_range_replay": [yes["ratio_min"], yes["ratio_max"]], "engine_wall_s": wall})
        print(table_row(rows[-1]), flush=True)
    return rows


def read_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a published step (any shard layout; the
    publisher's checksums are the loader's business, not this benchmark's)."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


HEADER = (f"{'model':<11} {'weights':<22} {'trainer':<8} {'tokens':>6} {'kl_no_replay':>12} {'kl_replay':>10} "
          f"{'routing_dis':>11} {'kl_reduction':>12}")


def table_row(r: dict) -> str:
    return (f"{r['model']:<11} {r['weights'][-22:]:<22} {r['trainer_dtype'][:8]:<8} {r['num_tokens']:>6} "
            f"{r['kl_no_replay']:>12.3e} {r['kl_replay']:>10.3e} {r['routing_disagreement']:>11.4f} "
            f"{r['kl_reduction']:>11.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--weights", default=None, help="also score a published tiny_moe weights/step_N dir (trained)")
    p.add_argument("--weights-note", default="", help="where --weights came from (recorded in the JSON)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(HEADER)
    rows: list[dict] = []
    for name in args.models.split(","):
        rows += measure(name, f"seeded init ({SEED})", build_model(MODELS[name], SEED), args)
    if args.weights:
        master = TinyMoeForCausalLM(MODELS["tiny_moe"])
        master.load_state_dict(read_weights(Path(args.weights)))
        rows += measure("tiny_moe", f"trained {Path(args.weights).name}", master, args)
    head = next(r for r in rows if r["model"] == rows[0]["model"] and r["trainer_dtype"] == "float32")
    summary = {"kl_reduction": head["kl_reduction"], "target": 10.0, "meets_target": head["kl_reduction"] >= 10,
               "headline": f"{head['model']}, {head['weights']}, trainer fp32 vs inference bf16",
               "by_row": {f"{r['model']}|{r['weights']}|{r['trainer_dtype']}": r["kl_reduction"] for r in rows}}
    out = {"rows": rows, "summary": summary, "config": vars(args), "wall_s": time.perf_counter() - t0,
           "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"kl_reduction (headline: {summary['headline']}) = {summary['kl_reduction']:.2f}x, target >= 10: "
          f"{'met' if summary['meets_target'] else 'NOT met'}; wrote {args.out} in {out['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
