"""The trainer's loop: one process per rank, started as ``python -m workers.trainer``.

Per step N (batch N trains step N and yields weights version N+1):
  wait rollouts/step_N/READY (orchestrator) -> load, take rows rank::dp -> barrier, rank 0
  prunes old rollouts -> forward (Router Replay when asked) -> loss with global
  normalisers -> backward -> all-reduce grads -> clip -> AdamW -> rank 0 publishes
  weights/step_{N+1} and appends the metrics record.
Before step 0 rank 0 publishes weights/step_0 (the seeded init) for inference to load;
after the last step it writes ``run_dir/TRAINER_DONE``.

Who waits for whom: every rank waits for the orchestrator's batch (deadline
trainer.batch_timeout_s); ranks wait for each other only inside collectives (the
process-group timeout, batch_timeout_s + 60 s, since a rank may be that late). Nobody
waits for inference: the orchestrator decides when workers load a published step.

SIGTERM stops at once (nothing is finished or flushed beyond the last full metrics line;
a half-written weights dir stays a ``.step_N.tmp`` that readers ignore): the process group
is destroyed and the process exits with 143 (128 + SIGTERM).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
from typing import Iterator, Optional

import torch

from workers.common.config import RunConfig, TrainerConfig
from workers.common.protocol import RunPaths
from workers.common.topology import Topology
from workers.modeling.tiny_moe import TinyMoeConfig, TinyMoeForCausalLM, build_model, num_parameters
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.batch import RolloutBatch, batch_staleness, load_batch, prune_rollouts, shard_rows, wait_for_batch
from workers.trainer.loss import (TokenStats, load_balance_loss, loss_relevant_inputs, own_topk, policy_loss,
                                  router_stats, routing_disagreement, token_logprobs)
from workers.trainer.metrics import MetricsWriter, get_logger, progress_line
from workers.trainer.parallel import ParallelDims
from workers.weights.filesystem import publish_step

TRAINER_DONE = "TRAINER_DONE"
EXIT_SIGTERM = 128 + signal.SIGTERM
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class TrainerStopped(BaseException):
    """Raised from the SIGTERM handler (a BaseException so no ``except Exception`` eats it)."""


def train(topology: Topology, cfg: RunConfig) -> int:
    """Run every trainer step of the run on this rank; returns the process exit code."""
    paths, tcfg = RunPaths(topology.run_dir), cfg.trainer
    torch.set_num_threads(tcfg.num_threads)
    log = get_logger(topology.rank)
    _install_sigterm()
    dims: Optional[ParallelDims] = None
    metrics: Optional[MetricsWriter] = None
    try:
        if tcfg.num_ranks != topology.world_size:
            raise ValueError(f"trainer.num_ranks({tcfg.num_ranks}) != trainer world size({topology.world_size}) "
                             f"in this process's environment: the launcher started the wrong number of ranks")
        dims = ParallelDims.init(topology, timeout_s=tcfg.batch_timeout_s + 60.0)
        model = build_model(model_config(cfg), cfg.model.init_seed, dtype_of(tcfg)).to(dims.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay)
        ckpt = Checkpointer(paths.root, rank=dims.rank, world_size=dims.world_size, log=log,
                            every=tcfg.checkpoint_every_steps, keep=tcfg.num_checkpoints_kept)
        start = ckpt.load(model, optimizer)  # 0 unless a checkpoint exists (restart, Slurm requeue)
        ckpt.install_signals(model, optimizer)  # SIGUSR1: save after this step; SIGTERM: save, then stop
        if dims.is_rank0:
            metrics = MetricsWriter(paths)
            sync = publish_weights(paths, start, model, keep_last=cfg.weights.keep_last)
            log.info(f"dp {dims.dp} ({dims.backend}, {dims.device}), {num_parameters(model.config) / 1e6:.2f}M params, "
                     f"router_replay={tcfg.router_replay}; published weights step 0 in {sync['weight_sync_s']:.3f}s")
        for step in range(start, tcfg.num_steps):
            idle_s = wait_for_batch(paths, step, timeout_s=tcfg.batch_timeout_s)
            ckpt.begin_step()
            t0 = time.perf_counter()
            batch = load_batch(paths.rollouts(step), step=step, num_layers=model.config.num_layers,
                               top_k=model.config.top_k, num_experts=model.config.num_experts)
            shard = shard_rows(batch, dims.dp_rank, dims.dp).to(dims.device)
            dims.barrier()  # every rank holds batch N in memory: old rollout dirs may go
            if dims.is_rank0:
                prune_rollouts(paths, ckpt.prune_bound(step))  # keep what a resume would redo
            stats = train_step(model, optimizer, shard, tcfg, dims)
            if tcfg.simulated_step_delay_s > 0:  # benchmarks/tests: emulate a big, slow trainer
                time.sleep(tcfg.simulated_step_delay_s)
            if dims.is_rank0:
                sync = publish_weights(paths, step + 1, model, keep_last=cfg.weights.keep_last)
                record = step_record(step, batch, stats, sync, idle_s=idle_s, step_time_s=time.perf_counter() - t0, lr=tcfg.lr)
                metrics.write(record)
                log.info(progress_line(record, tcfg.num_steps))
            ckpt.end_step(step, model, optimizer)
        if dims.is_rank0:
            (paths.root / TRAINER_DONE).write_text(json.dumps({"time": time.time(), "num_steps": tcfg.num_steps}))
            log.info(f"done: {tcfg.num_steps} steps, wrote {paths.root / TRAINER_DONE}")
        return 0
    except TrainerStopped:
        log.warning("SIGTERM: stopping now")
        return EXIT_SIGTERM
    except Exception as e:
        if _STOPPING:  # SIGTERM came while in a collective that a peer's exit broke first
            log.warning(f"SIGTERM: stopping now ({type(e).__name__} on the way out)")
            return EXIT_SIGTERM
        log.error(f"{type(e).__name__}: {e}")
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if dims is not None:
            dims.destroy()


def train_step(model: TinyMoeForCausalLM, optimizer: torch.optim.Optimizer, shard: RolloutBatch,
               tcfg: TrainerConfig, dims: ParallelDims) -> dict[str, float]:
    """One optimizer step on this rank's rows; returns GLOBAL (all-reduced) statistics.

    Two small all-reduces bracket the backward: token/expert counts before it (the loss
    needs global normalisers), the statistic sums after it; the gradients travel in one
    flat bucket in between. All ranks end with identical gradients and hence weights.
    """
    mcfg = model.config
    replay = tcfg.router_replay and shard.routed_experts is not None
    model.train()
    with capture_gate_logits(model) as gates:
        out = model(shard.input_ids, attention_mask=shard.attention_mask,
                    forced_experts=shard.routed_experts if replay else None,
                    forced_mask=shard.routed_mask if replay else None)
    logp, entropy = token_logprobs(out.logits, shard.input_ids, shard.temperature)
    prob_sums, counts = router_stats(gates, out.routed_experts, shard.attention_mask, mcfg.num_experts)

    local = torch.cat([torch.tensor([int(shard.loss_mask.sum()), int(shard.attention_mask.sum())], dtype=torch.float64,
                                    device=counts.device), counts.flatten().double()])
    totals = dims.all_reduce(local)
    num_loss_tokens, num_valid = float(totals[0]), float(totals[1])
    pg_loss, tok = policy_loss(logp, shard.inference_logprobs, shard.advantages, shard.loss_mask,
                               num_loss_tokens=num_loss_tokens, ratio_cap=tcfg.ratio_cap,
                               ratio_mask_low=tcfg.ratio_mask_low, ratio_mask_high=tcfg.ratio_mask_high, entropy=entropy)
    aux_loss = load_balance_loss(prob_sums, totals[2:].view(counts.shape), num_valid, mcfg.top_k)
    loss = pg_loss + tcfg.aux_loss_coef * aux_loss

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    dims.all_reduce_grads(model.parameters())
    max_norm = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    optimizer.step()

    disagree = (0.0, 0.0)
    if shard.routed_experts is not None:
        own = own_topk(gates, mcfg.top_k, tuple(shard.input_ids.shape))
        slots = loss_relevant_inputs(shard.loss_mask) & shard.routed_mask
        disagree = routing_disagreement(own, shard.routed_experts, slots)
    return reduce_stats(dims, tok, pg_loss=pg_loss.item(), aux_loss=aux_loss.item(), aux_coef=tcfg.aux_loss_coef,
                        grad_norm=grad_norm, disagree=disagree if shard.routed_experts is not None else None)


def reduce_stats(dims: ParallelDims, tok: TokenStats, *, pg_loss: float, aux_loss: float, aux_coef: float,
                 grad_norm: float, disagree: Optional[tuple[float, float]]) -> dict[str, float]:
    """All-reduce per-rank sums / extremes and turn them into the step's global means."""
    sums = [getattr(tok, f) for f in TokenStats.SUM_FIELDS] + [pg_loss, aux_loss] + list(disagree or (0.0, 0.0))
    s = dims.all_reduce(torch.tensor(sums, dtype=torch.float64, device=dims.device)).tolist()
    g = dict(zip(TokenStats.SUM_FIELDS + ("pg_loss", "aux_loss", "disagree", "slots"), s))
    ext = dims.all_reduce(torch.tensor([tok.ratio_max, -tok.ratio_min], dtype=torch.float64, device=dims.device), op="max")
    n = g["num_tokens"]
    per_token = (lambda x: x / n) if n else (lambda x: float("nan"))
    stats = {
        "loss": g["pg_loss"] + aux_coef * g["aux_loss"],
        "pg_loss": g["pg_loss"],
        "aux_loss": g["aux_loss"],
        "grad_norm": grad_norm,
        "entropy": per_token(g["entropy_sum"]),
        "mismatch_kl": per_token(g["k3_sum"]),
        "ratio_mean": per_token(g["ratio_sum"]),
        "ratio_max": float(ext[0]),
        "ratio_min": -float(ext[1]),
        "ratio_masked_frac": per_token(g["num_masked"]),
        "ratio_capped_frac": per_token(g["num_capped"]),
        "num_loss_tokens": int(n),
    }
    if disagree is not None:
        stats["routing_disagreement"] = g["disagree"] / g["slots"] if g["slots"] else float("nan")
    return stats


def step_record(step: int, batch: RolloutBatch, stats: dict, sync: dict, *, idle_s: float, step_time_s: float,
                lr: float) -> dict:
    """The metrics.jsonl record of one step (keys listed in workers/trainer/metrics.py).

    ``step_time_s`` is the busy wall time (load .. publish), ``idle_s`` the wait for the
    batch before it; ``tokens_per_s`` counts loss tokens (all ranks) per busy second.
    """
    record = dict(batch.meta.get("orchestrator_metrics") or {})
    record.update(stats)
    record.update(sync)
    record.update({
        "step": step,
        "policy_version": step + 1,
        "time": time.time(),
        "num_rows": batch.num_rows,
        "step_time_s": step_time_s,
        "idle_s": idle_s,
        "trainer_idle_frac": idle_s / max(idle_s + step_time_s, 1e-9),
        "tokens_per_s": stats["num_loss_tokens"] / max(step_time_s, 1e-9),
        "lr": lr,
    })
    # The orchestrator is the source of these; fall back on what the batch itself says.
    record.setdefault("reward_mean", float(batch.rewards.mean()) if batch.num_rows else float("nan"))
    record.setdefault("max_staleness", batch_staleness(batch, step))
    record.setdefault("samples_dropped_stale", 0)
    return record


def publish_weights(paths: RunPaths, version: int, model: torch.nn.Module, *, keep_last: int) -> dict:
    """Write weights/step_<version> (rank 0 only); returns the weight_sync_* metrics."""
    out = publish_step(paths.weights(0).parent, version, model.state_dict(), keep_last=keep_last)
    return {"weight_sync_s": out["seconds"], "weight_sync_gbps": out["bytes"] / max(out["seconds"], 1e-9) / 1e9,
            "weight_bytes": out["bytes"]}


@contextlib.contextmanager
def capture_gate_logits(model: TinyMoeForCausalLM) -> Iterator[list[torch.Tensor]]:
    """Collect every MoE layer's router logits ``[B*T, E]`` (in layer order) during a forward.

    The loss needs router probabilities (for the DP-exact balance loss) and the router's
    own top-k (for routing_disagreement under replay); hooks get both from the one
    training forward instead of a second forward.
    """
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: captured.append(out)) for layer in model.model.layers]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def model_config(cfg: RunConfig) -> TinyMoeConfig:
    """ModelConfig -> TinyMoeConfig by field name (the model's own defaults fill the rest)."""
    names = {f.name for f in dataclasses.fields(TinyMoeConfig)}
    return TinyMoeConfig(**{k: v for k, v in dataclasses.asdict(cfg.model).items() if k in names})


def dtype_of(tcfg: TrainerConfig) -> torch.dtype:
    if tcfg.dtype not in DTYPES:
        raise ValueError(f"trainer.dtype={tcfg.dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[tcfg.dtype]


_STOPPING: list[bool] = []  # non-empty once SIGTERM arrived


def _install_sigterm() -> None:
    def handler(signum, frame):
        _STOPPING.append(True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills outright
        raise TrainerStopped()

    signal.signal(signal.SIGTERM, handler)
