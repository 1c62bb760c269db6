"""The trainer's loop: one process per rank, started as ``python -m workers.trainer``.

Steps are 1-based (docs/design.md, "Step numbers"): weights/step_0 is the initial policy, and step N
(1..trainer.num_steps) trains batch rollouts/step_N from the weights of step N-1 and yields
weights version N; checkpoints/step_N holds the state after step N. Per step N:
  wait rollouts/step_N/READY (orchestrator) -> load, take row shard ``batch_rank`` of
  ``ep * dp`` (TP peers take the same rows) -> barrier, rank 0 prunes old rollouts ->
  train_step (step.py: per micro-batch forward with Router Replay when asked, loss with
  global normalisers, backward; grad sync, clip, AdamW) -> every rank publishes weights/step_N
  through the transport, the full HF tensors (cast to trainer.dtype) gathered one at a time
  as the transport writes or sends them (weight_stream.py) -> rank 0 appends the metrics record.
The sharding plan (ModelSpec.trainer_plan): tp = ep = 1 -> FSDP2 over every rank for any
family (workers/trainer/parallel/fsdp.py; checkpoints through torch.distributed.checkpoint, resumable
at another layout); tp or ep > 1 -> the mesh plan (workers/trainer/parallel/mesh.py: FSDP2 + DTensor
tensor parallel + expert parallel on one DeviceMesh, for every family; DCP checkpoints too).
Parameters and AdamW state are in trainer.master_dtype, compute in trainer.dtype
(workers/trainer/precision.py); activation checkpointing wraps every decoder layer first.
Before step 1 rank 0 publishes weights/step_0 (the seeded init) for inference to load;
after the last step it writes ``run_dir/TRAINER_DONE``. The parallel degrees come from
``trainer.parallel`` (ParallelConfig.resolve checks tp * pp * ep * dp == trainer.num_ranks).

Who waits for whom: every rank waits for the orchestrator's batch (deadline
trainer.batch_timeout_s); ranks wait for each other only inside collectives (the
process-group timeout, batch_timeout_s + 60 s, since a rank may be that late). With the
filesystem transport nobody waits for inference (the orchestrator decides when workers load
a published step); with ``weights.transport=broadcast`` the senders wait for the
orchestrator's request marker and then for the receivers inside the weight group
(deadline weights.broadcast_timeout_s). Each transport's protocol: workers/weights/<transport>/__init__.py.

SIGTERM stops at once (nothing is finished or flushed beyond the last full metrics line;
a half-written weights dir stays a ``.step_N.tmp`` that readers ignore): the process group
is destroyed and the process exits with 143 (128 + SIGTERM).
"""
from __future__ import annotations

import json
import signal
import time
from typing import Optional

import torch

from workers.weights.lora_publisher import make_lora_publisher
from workers.weights.lora_steps import lora_mode
from workers.common.gc_pauses import settle as settle_gc
from workers.common.config import ConfigError, RunConfig
from workers.common.exits import EXIT_FATAL
from workers.common.protocol import RunPaths
from workers.common.registry import MODELS, TRANSPORTS
from workers.common.timeline import TimelineWriter, now
from workers.common.topology import Topology
from workers.models.spec import FSDP_PLAN, MESH_PLAN
from workers.common.heartbeat import Heartbeat
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.divergence import DivergenceGuard
from workers.trainer.batch import RolloutBatch, batch_staleness, load_batch, prune_rollouts, shard_rows, wait_for_batch
from workers.common.metrics import MetricsWriter
from workers.trainer.metrics import get_logger, progress_line
from workers.trainer.tracking import make_tracker
from workers.trainer.optimizer import ShardLocalAdamW
from workers.trainer.parallel.dims import ParallelDims
from workers.trainer.router_replay import MISALIGNED_DISAGREEMENT
from workers.trainer import lora_publish
from workers.trainer.parallel import expert_capacity, plans
from workers.trainer.compile import apply_compile, resolve as resolve_compile
from workers.trainer.micro import apply_activation_checkpointing
from workers.trainer.precision import Precision
from workers.trainer.step import train_step
from workers.trainer.weight_stream import ModelWeights
from workers.weights.base import NonFiniteWeights, WeightPublisher

EXIT_SIGTERM = 128 + signal.SIGTERM


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
    publisher: Optional[WeightPublisher] = None
    timeline: Optional[TimelineWriter] = None
    try:
        if tcfg.num_ranks != topology.world_size:
            raise ConfigError(f"trainer.num_ranks({tcfg.num_ranks}) != trainer world size({topology.world_size}) "
                             f"in this process's environment: the launcher started the wrong number of ranks")
        tp, ep, cp = parallel_degrees(cfg)
        dims = ParallelDims.init(topology, timeout_s=tcfg.batch_timeout_s + 60.0, tp=tp, ep=ep, cp=cp)
        model = step0_model(cfg, dims)  # this rank's shard of the step-0 weights, master dtype
        optimizer = build_optimizer(model, tcfg)
        ckpt = Checkpointer(paths.root, rank=dims.rank, world_size=dims.world_size, log=log,
                            every=tcfg.checkpoint_every_steps, keep=tcfg.num_checkpoints_kept)
        start = ckpt.load(model, optimizer)  # steps done: 0 unless a checkpoint exists (restart, Slurm requeue)
        guard = DivergenceGuard(skip=cfg.weights.skip_nonfinite, max_skips=cfg.weights.max_nonfinite_skips, ckpt=ckpt,
                                group=dims.group, device=dims.device, log=log)
        guard.ensure_restore_point(start, model, optimizer)  # skip_nonfinite: a finite state to go back to
        ckpt.install_signals(model, optimizer)  # SIGUSR1: save after this step; SIGTERM: save, then stop
        # LoRA mode: step 0 the base, then adapters, whatever the transport (workers/weights/lora_publisher.py)
        make_publisher = make_lora_publisher if lora_mode(cfg) else TRANSPORTS.get(cfg.weights.transport).publisher
        publisher = make_publisher(cfg, paths, topology, rank=dims.rank, world_size=dims.world_size, device=dims.device)
        to_hf = MODELS.get(cfg.model.family).to_hf  # published weights carry HF names
        compute = Precision.of(tcfg).compute  # published weights: the compute dtype, as inference runs them
        weights = ModelWeights(model, dtype=compute, to_hf=to_hf)  # gathered tensor by tensor while published
        sync = publish_version(publisher, start, weights, cfg, paths, dims)  # collective: every rank writes or sends a share
        if dims.is_rank0:
            metrics = MetricsWriter(paths, tracker=make_tracker(cfg, paths, log=log))
            timeline = TimelineWriter(paths.root, "trainer", log=log)  # per-step marks (workers/common/timeline.py)
            beat = Heartbeat()  # host RSS, and GPU memory/utilization where NVML is present
            log.info(f"tp {dims.tp} x cp {dims.cp} x ep {dims.ep} x dp {dims.dp} ({dims.backend}, {dims.device}), plan "
                     f"{trainer_plan(cfg)}, master {tcfg.master_dtype} / compute {tcfg.dtype}, compile "
                     f"{resolve_compile(tcfg.compile, dims.device)}, "
                     f"{num_parameters(cfg) / 1e6:.2f}M params"
                     + (f" (LoRA rank {tcfg.lora.rank}: {num_trainable(model) / 1e6:.3f}M trainable on this rank)"
                        if tcfg.lora.enabled else "") + f", router_replay={tcfg.router_replay}; "
                     f"published weights step {start} in {sync['weight_sync_s']:.3f}s")
        settle_gc(log if dims.is_rank0 else None, role="trainer")  # model, optimizer, groups: start-up state
        warned = False
        for step in range(start + 1, tcfg.num_steps + 1):  # 1-based: step N publishes weights/step_N
            marks = {"wait_start": now()}
            idle_s = wait_for_batch(paths, step, timeout_s=tcfg.batch_timeout_s, publisher=publisher)
            marks["batch_ready"] = now()
            ckpt.begin_step()
            t0 = time.perf_counter()
            batch = load_batch(paths.rollouts(step), step=step, num_layers=model.config.num_routed_layers,
                               top_k=model.config.top_k, num_experts=model.config.num_experts,
                               adapters=tuple(tcfg.lora.adapters))
            shard = shard_rows(batch, dims.batch_rank, dims.num_batch_shards).to(dims.device)
            dims.barrier()  # every rank holds batch N in memory: old rollout dirs may go
            if dims.is_rank0:
                prune_rollouts(paths, ckpt.prune_bound(step))  # keep what a resume would redo
            marks["loaded"] = now()
            stats = train_step(model, optimizer, shard, tcfg, dims)
            guard.check(step, model, optimizer, stats)  # skip_nonfinite: NaN/inf -> restore (never published)
            if tcfg.router_replay and stats.get("routing_disagreement", 0.0) > MISALIGNED_DISAGREEMENT and not warned:
                warned = True
                log.warning(f"step {step}: routing_disagreement {stats['routing_disagreement']:.2f} under Router Replay: "
                            f"the replayed experts look misaligned with their tokens (see workers/trainer/router_replay.py)")
            if tcfg.simulated_step_delay_s > 0:  # benchmarks/tests: emulate a big, slow trainer
                time.sleep(tcfg.simulated_step_delay_s)
            marks["trained"] = now()  # the stats' floats synchronized the step's device work
            if step == start + 1:  # the first step compiled and warmed up: ~100k more objects that live as long
                settle_gc(log if dims.is_rank0 else None, role="trainer after its first step")
            weights = ModelWeights(model, dtype=compute, to_hf=to_hf)  # a fresh view of the updated shards
            sync = publish_version(publisher, step, weights, cfg, paths, dims)
            marks["published"] = now()
            if dims.is_rank0:
                timeline.write("step", step, **marks)
                record = step_record(step, batch, stats, sync, idle_s=idle_s, step_time_s=time.perf_counter() - t0, lr=tcfg.lr)
                record.update(beat.sample())
                metrics.write(record)
                log.info(progress_line(record, tcfg.num_steps))
            ckpt.end_step(step, model, optimizer)
        ckpt.save(ckpt.done_step, model, optimizer)  # a resumed run that trains further redoes no step
        if dims.is_rank0:
            paths.trainer_done.write_text(json.dumps({"time": time.time(), "num_steps": tcfg.num_steps}))
            log.info(f"done: {tcfg.num_steps} steps, wrote {paths.trainer_done}")
        return 0
    except TrainerStopped:
        log.warning("SIGTERM: stopping now")
        return EXIT_SIGTERM
    except NonFiniteWeights as e:  # every rank raises it together (the publisher's gather, the guard's all-reduce)
        log.error(f"stopping: {e}")
        return EXIT_FATAL  # deterministic: a restart would diverge again (workers/common/exits.py)
    except ConfigError as e:
        log.error(f"stopping: {e}")
        return EXIT_FATAL
    except Exception as e:
        if _STOPPING:  # SIGTERM came while in a collective that a peer's exit broke first
            log.warning(f"SIGTERM: stopping now ({type(e).__name__} on the way out)")
            return EXIT_SIGTERM
        log.error(f"{type(e).__name__}: {e}")
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if timeline is not None:
            timeline.close()
        if publisher is not None:
            publisher.close()
        if dims is not None:
            dims.destroy()


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
        "policy_version": step,  # the weights this step published (weights/step_N)
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


def publish_weights(publisher: WeightPublisher, version: int, weights: ModelWeights) -> dict:
    """Publish weights ``version`` through ``weights.transport``; returns the weight_sync_* metrics
    of workers.weights.base.SyncStats.

    COLLECTIVE: every rank calls it with the same stream and iterates it whole (a gather per
    tensor: no rank ever holds the full model, workers/trainer/weight_stream.py). filesystem:
    each rank writes a share of the shards of weights/step_<version>, rank 0 the index and STABLE. broadcast
    (step 0 still on disk): each rank sends its share once the orchestrator has paused the
    workers and asked for this version; waiting for that request is ``weight_sync_wait_s``
    (deadline weights.broadcast_timeout_s), the transfer ``weight_sync_s``. The protocols
    and who waits for whom: workers/weights/<transport>/__init__.py.
    """
    device = next((p.device for p in weights.model.parameters()), None) if hasattr(weights, "model") else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)  # the step's queued GPU work is training time, not publishing time
    return publisher.publish(version, weights).metrics()


def publish_version(publisher: WeightPublisher, version: int, weights: ModelWeights, cfg: RunConfig, paths: RunPaths,
                    dims: ParallelDims) -> dict:
    """:func:`publish_weights`, or under LoRA after version 0 the adapter (workers/trainer/lora_publish.py)."""
    if cfg.trainer.lora.enabled and version > 0:
        return lora_publish.publish_adapter(publisher, version, weights.model, cfg, paths, rank=dims.rank,
                                            dtype=Precision.of(cfg.trainer).compute)
    return publish_weights(publisher, version, weights)


def parallel_degrees(cfg: RunConfig) -> tuple[int, int, int]:
    """(tp, ep, cp) from ``trainer.parallel`` through the same check the plan ran (for hand-started ranks)."""
    d = cfg.trainer.parallel.resolve(cfg.trainer.num_ranks)
    return d["tp"], d["ep"], d["cp"]


def build_optimizer(model, tcfg) -> torch.optim.AdamW:
    """AdamW over this rank's (sharded) parameters, stepping their local shards
    (workers/trainer/optimizer.py: DTensor dispatch made the fused kernel slower than foreach).
    On CUDA the fused kernel (one launch per dtype group instead of foreach's several passes: the
    H200 profile of 2026-12-03 had AdamW at 16% of the step's GPU time); elsewhere the default."""
    fused = all(p.is_cuda for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only (no state for the base)
    return ShardLocalAdamW(trainable, lr=tcfg.lr, betas=tuple(tcfg.betas), weight_decay=tcfg.weight_decay,
                           fused=fused or None)


def step0_model(cfg: RunConfig, dims: ParallelDims):
    """This rank's shard of the step-0 model under :func:`trainer_plan`, compiled per layer (trainer.compile)
    and activation checkpointing applied.

    Under either built-in plan (FSDP, mesh) with a seeded init or a ``model.path`` checkpoint: built on
    the meta device, sharded, then each rank fills only its shards, one full tensor at a time
    (``seeded_tensors``, or the checkpoint tensors it holds: hf_checkpoint.checkpoint_tensors), so
    no rank holds the whole model (the GLM-5 / Kimi-K2 layouts could not); the values are those of
    :func:`initial_model`, bit for bit (tests/integration/test_publish_stream.py). Otherwise (a
    ``model.pretrained`` conversion, or a family's own plan) every rank builds the full model on the
    CPU, then shards it."""
    spec, precision, lora = MODELS.get(cfg.model.family), Precision.of(cfg.trainer), cfg.trainer.lora.enabled
    lora_publish.check_layout(cfg)
    if trainer_plan(cfg) in (FSDP_PLAN, MESH_PLAN) and not cfg.model.pretrained:
        from workers.models.hf_checkpoint import checkpoint_tensors
        from workers.trainer.parallel.fsdp import materialize

        # LoRA: the frozen base in the compute dtype (no master copy), float32 adapters (lora_publish.py)
        full = spec.build(cfg.model, device="meta", dtype=precision.compute if lora else precision.master)
        apply_activation_checkpointing(full.model.layers, cfg.trainer.activation_checkpointing)
        apply_compile(full.model.layers, cfg.trainer.compile, device=dims.device)  # wraps the checkpoint
        # both streams read names and full shapes now, before sharding changes them
        tensors = (checkpoint_tensors(full, cfg.model, spec.checkpoint_from_hf(cfg.model)) if cfg.model.path
                   else full.seeded_tensors(cfg.model.init_seed))
        if lora:
            tensors = lora_publish.add_adapters(cfg, full, tensors)
        return materialize(parallelize(cfg, full, dims), tensors, dims.device)
    full = initial_model(cfg).to(dims.device)  # master dtype: workers/trainer/precision.py
    if lora:
        full = full.to(precision.compute)
        lora_publish.init_in_place(cfg, full)
    apply_activation_checkpointing(full.model.layers, cfg.trainer.activation_checkpointing)
    apply_compile(full.model.layers, cfg.trainer.compile, device=dims.device)  # wraps the checkpoint
    return parallelize(cfg, full, dims)


def initial_model(cfg: RunConfig):
    """Step-0 weights in the MASTER dtype, as the model family makes them (``ModelSpec.init``: the
    seeded init, or the converted pretrained checkpoint of model.pretrained)."""
    return MODELS.get(cfg.model.family).init(cfg.model, Precision.of(cfg.trainer).master)


def trainer_plan(cfg: RunConfig) -> str:
    """Name of the sharding plan in workers/trainer/parallel/plans.py (``fsdp`` when tp = ep = 1, else the family's)."""
    par = cfg.trainer.parallel
    return MODELS.get(cfg.model.family).trainer_plan(par.tp, par.ep)


def parallelize(cfg: RunConfig, full, dims: ParallelDims):
    """This rank's shard of ``full`` under :func:`trainer_plan`, with the run's mixed precision and
    expert-parallel dispatch (trainer.parallel.ep_capacity_factor: workers/trainer/parallel/expert_capacity.py)."""
    model = plans.shard(MODELS.get(cfg.model.family), full, dims, precision=Precision.of(cfg.trainer))
    expert_capacity.configure(model, cfg.trainer.parallel.ep_capacity_factor)
    return model


def num_parameters(cfg: RunConfig) -> int:
    """Parameters of the full model (built on the meta device: nothing allocated)."""
    return sum(p.numel() for p in MODELS.get(cfg.model.family).build(cfg.model, device="meta").parameters())


def num_trainable(model) -> int:
    """Trainable parameter elements this rank holds (LoRA: its shards of the adapters)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters() if p.requires_grad)


_STOPPING: list[bool] = []  # non-empty once SIGTERM arrived


def _install_sigterm() -> None:
    def handler(signum, frame):
        _STOPPING.append(True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills outright
        raise TrainerStopped()

    signal.signal(signal.SIGTERM, handler)
