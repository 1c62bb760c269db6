"""The orchestrator's loop: keep inference busy, hand the trainer fresh-enough batches.

    until every trainer step has its batch:
        if the trainer published newer weights: pause -> load or send -> verify -> continue
            (the transport's coordinator, workers/weights/<transport>/coordinator.py)
        maybe start an evaluation of the current weights (evaluation.py), beside the rollouts
        start as many prompt groups as the next batches can still use
        wait a moment for groups to finish; put them in the buffer
        while the buffer holds a batch for the next step: write it (stale groups dropped)

The bound on in-flight work (``max_inflight_rollouts``) and the staleness window
(``max_off_policy_steps``) are the only knobs; with a window of 0 this is synchronous
on-policy RL, with the same code.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from typing import Any, Optional

import aiohttp

from workers.common.config import RunConfig
from workers.common.inference_client import InferenceClient, InferenceError, wait_until_ready
from workers.common.logs import get_logger
from workers.common.protocol import INFERENCE_HEALTH, LEDGER_FILE, USER_ERROR_EXIT, RunPaths, read_admin_token
from workers.common.registry import BACKENDS, TRANSPORTS
from workers.common.timeline import TimelineWriter, now
from workers.common.topology import Topology
from workers.orchestrator.adapters import adapter_of, client_for, trained_adapters
from workers.orchestrator.batch_writer import BatchWriter, RewardsFailing
from workers.orchestrator.buffer import RolloutBuffer, RolloutGroup, Shaping, groups_to_launch
from workers.orchestrator.envs import make_env
from workers.orchestrator.envs.latency import LatencyModel
from workers.orchestrator.episodes import run_episode_group
from workers.orchestrator.evaluation import Evaluator
from workers.orchestrator.faults import WorkerPool
from workers.orchestrator.final_eval import evaluate_final_weights
from workers.orchestrator.ledger import Ledger
from workers.orchestrator.rollouts import BusyMeter, RateWindow
from workers.orchestrator.scoring import Scorers
from workers.orchestrator.weight_updates import UpdateRunner
from workers.common.gc_pauses import settle as settle_gc
from workers.common.heartbeat import Heartbeat
from workers.weights.lora_coordinator import (AdapterClient, AdapterNotDelivered, LoraCoordinator, SGLangLoraCoordinator,
                                              make_lora_coordinator)
from workers.weights.lora_steps import lora_mode


#: The longest a loop turn waits for a group to finish before it looks for new weights again: newly
#: published weights wait for it (timeline phase ``apply_wait``), and in a generation-bound run
#: every batch's generation waits for them. A turn that finds nothing to do costs ~0.1 ms of CPU.
LOOP_WAIT_S = 0.01


class Orchestrator(BatchWriter):
    """The loop (module docstring); writing the ready batches and their metrics: batch_writer.py."""

    def __init__(self, cfg: RunConfig, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.paths = RunPaths(topo.run_dir)
        self.log = get_logger("orchestrator", 0)
        self.env = make_env(cfg.env, seed=cfg.seed, model=cfg.model)
        o = cfg.orchestrator
        self.group_size = o.num_samples_per_prompt
        shaping = Shaping(o.overlong_buffer_frac, o.overlong_penalty) if o.overlong_buffer_frac else None
        self.buffer = RolloutBuffer(max_off_policy_steps=o.max_off_policy_steps, groups_per_step=o.num_prompts_per_step,
                                    advantage=o.advantage, long_episode_policy=o.long_episode_policy,
                                    advantage_norm=o.advantage_norm, shaping=shaping,
                                    dynamic_sampling=o.dynamic_sampling, max_draws=o.dynamic_sampling_max_draws,
                                    distill_reward_weight=(cfg.algorithm.teacher.reward_weight
                                                           if cfg.algorithm.teacher.path else None))
        self.scorers = Scorers()  # the KL reference / distillation teacher (scoring.py), built in run()
        self.inflight: dict[asyncio.Task, int] = {}  # task -> worker index
        self.clients: list[InferenceClient] = []  # every server, directly: readiness and admin calls
        self.router: Optional[Any] = None  # a backend's router (spec.make_router; SGLang: smg): generation only
        self.version = 0
        self.next_step = 1  # the step whose batch comes next; steps are 1-based (trainer step N trains batch N)
        self.next_group_id = 0
        self.rate = RateWindow()  # completion tokens/s since the first request (inference_tokens_per_s)
        self.dropped_at_last_batch = 0
        self.failed_reward_steps = 0  # consecutive batches whose every reward call failed
        self.weights = (make_lora_coordinator(cfg, self.paths, log=self.log) if lora_mode(cfg) is not None else
                        TRANSPORTS.get(cfg.weights.transport).coordinator(cfg, self.paths, log=self.log))
        self.updates = UpdateRunner(self.weights, concurrent=not self.weights.pauses_generation
                                    and not isinstance(self.weights, LoraCoordinator))
        self.dropped_unconfirmed = 0  # LoRA mode: samples of a version their worker never confirmed
        self.latency = LatencyModel(cfg.env, seed=cfg.seed) if cfg.env.latency != "none" else None
        self.meter = BusyMeter()
        self.busy_at_last_batch, self.time_at_last_batch = 0.0, time.monotonic()
        # the timeline (workers/common/timeline.py): when each group finished, busy time spent paused for weights
        self.timeline = TimelineWriter(topo.run_dir, "orchestrator", log=self.log)
        self.group_done_at: dict[int, float] = {}
        self.paused_busy_s = 0.0
        self.gen_busy_at_last_batch = 0.0
        self.group_of: dict[asyncio.Task, tuple[int, object]] = {}  # task -> (group id, env task)
        self.retry: deque[tuple[int, object, str]] = deque()  # groups to run again (worker died / restart)
        self.pool: Optional[WorkerPool] = None
        self.ledger = Ledger(self.paths.root / LEDGER_FILE)
        self.beat = Heartbeat()  # the orchestrator's own host memory (and GPUs, where it has any)
        self.inference_beats: dict[int, dict] = {}  # worker -> its last heartbeat (watch_inference)
        self.adapters = trained_adapters(cfg)  # several LoRA adapters: one per env=mix entry (adapters.py)
        self.evaluator = Evaluator(self.env, every=o.eval_every_steps, num_samples=o.eval_num_samples, log=self.log,
                                   k=o.eval_k, temperature=o.temperature, success_reward=o.eval_success_reward,
                                   adapters=self.adapters)
        self.resume_from_ledger()

    def resume_from_ledger(self) -> None:
        """A restarted orchestrator continues where the last one stopped (ledger.py): the next
        step after the last batch written, pending groups re-run with the same ids and tasks
        (the env's task stream is replayed, so the data order is the same), new ids after."""
        led = self.ledger
        led.recover_batches(self.paths.root)
        self.next_step, pending = led.next_step, set(led.pending())
        changed = []
        for gid in range(led.groups_started):
            task = self.env.sample_task()
            if gid in led.launched and task.task_id != led.launched[gid]:
                changed.append((gid, task.task_id))
            if gid in pending:
                self.retry.append((gid, task, "orchestrator restart"))
        if changed:  # a task id is the data position for env=dataset: the data or the env config changed
            (g, tid) = changed[0]
            self.log.warning("%d replayed tasks differ from the ledger's (first: group %d, task %s != %s): the env "
                             "config or its data changed since the run started", len(changed), g, tid, led.launched[g])
        self.next_group_id = led.groups_started
        state_file = self.paths.root / "orchestrator_state.json"
        if led.num_restarts and state_file.exists():
            dropped = json.loads(state_file.read_text()).get("dropped_total", 0)
            self.buffer.dropped_samples_total = self.dropped_at_last_batch = dropped
        if led.num_restarts:
            self.log.info("resumed from %s: next step %d, %d groups to re-run, %d started before", led.path,
                          self.next_step, len(self.retry), led.groups_started)


    async def run(self) -> None:
        timeout = self.cfg.orchestrator.request_timeout_s
        token = read_admin_token(self.paths)
        async with aiohttp.ClientSession() as session:
            self.clients, self.router = self.make_clients(token, session, timeout)
            await wait_until_ready(self.clients, self.cfg.inference.startup_timeout_s)
            await self.weights.start(self.clients)  # broadcast: every worker joins the weight group
            if self.router is not None:  # after the servers: the router's own check needs them up
                await wait_until_ready([self.router.health], self.cfg.inference.startup_timeout_s)
            self.log.info("%d inference workers ready; training %d steps", len(self.clients), self.cfg.trainer.num_steps)
            self.scorers = await asyncio.to_thread(Scorers.for_run, self.cfg, self.paths.weights(0), self.paths.root)
            o = self.cfg.orchestrator
            self.pool = WorkerPool(self.clients, num_misses=o.num_health_misses, timeout_s=o.health_check_timeout_s,
                                   log=self.log, on_event=self.ledger.note,
                                   health_file=self.paths.root / INFERENCE_HEALTH,
                                   kill_after_s=self.cfg.launcher.hung_worker_kill_s)
            settle_gc(self.log, role="orchestrator")  # clients, env, tokenizer, scorers: start-up state (gc_pauses.py)
            watcher = asyncio.create_task(self.watch_workers())
            beats = asyncio.create_task(self.watch_inference())
            try:
                while self.next_step <= self.cfg.trainer.num_steps:
                    await self.maybe_update_weights()
                    self.maybe_evaluate()
                    self.launch_groups()
                    await self.collect_finished(timeout_s=LOOP_WAIT_S)
                    self.write_ready_batches()
                if self.updates.task is not None:  # an update still running ends (and is recorded) before the final eval
                    await self.updates.wait()
                    await self.maybe_update_weights()
                self.ledger.abandon(self.ledger.pending())  # finished: nothing will train these
                for task in self.inflight:  # their groups are abandoned: free the workers for the final eval
                    task.cancel()
                await evaluate_final_weights(self)
            finally:
                self.updates.cancel()
                await self.evaluator.close()
                beats.cancel()
                watcher.cancel()
                for task in self.inflight:
                    task.cancel()
                await asyncio.gather(watcher, beats, *self.inflight, return_exceptions=True)
                self.ledger.close()
                self.timeline.close()
        self.paths.orchestrator_done.write_text(str(self.next_step - 1))
        self.log.info("all %d batches written; done", self.next_step - 1)

    async def maybe_update_weights(self) -> None:
        """The transport's coordinator: pause -> load or send -> verify -> continue, if newer weights exist
        (inline, or beside the loop for engines that generate through it: weight_updates.py).
        An update that happened is a timeline ``apply`` record; the busy time it held requests paused
        is not generation (``generation_s``), unless the workers were not paused."""
        ended = await self.updates.poll(self.pool, self.meter)
        if ended is None:  # running beside the loop: this turn goes on at the current version
            return
        start, busy = ended
        if self.weights.version != self.version:
            if self.weights.pauses_generation:  # embedded engines generate through their update (weight_swap.py)
                self.paused_busy_s += self.meter.busy_total() - busy
            # with the engine's own split of it (read, stage, lock_wait, swap: weight_swap.py), where it says
            self.timeline.write("apply", self.weights.version, start=start, end=now(),
                                **{f"engine_{k}": v for k, v in getattr(self.weights, "engine_timing", {}).items()})
            self.weights.engine_timing = {}  # a plugin's coordinator may not fill it: never a stale split
        self.version = self.weights.version
        if isinstance(self.weights, LoraCoordinator):  # a worker serving an unconfirmed adapter: run its groups elsewhere
            for task, worker in self.inflight.items():
                if not self.weights.samples_from(worker):
                    task.cancel()

    async def watch_workers(self) -> None:
        """Every ``orchestrator.health_check_interval_s``: health-check live workers (cancel the
        groups of newly dead ones: collect_finished resubmits them) and revive dead ones that
        answer again, at the current weight version (faults.py)."""
        while True:
            await asyncio.sleep(self.cfg.orchestrator.health_check_interval_s)
            for w in await self.pool.check_live():
                for task, worker in self.inflight.items():
                    if worker == w:
                        task.cancel()
            for w in range(len(self.clients)):
                if not self.pool.alive[w]:
                    await self.weights.revive(self.pool, w, self.current_weights)

    def maybe_evaluate(self) -> None:
        """Start an eval of the current weights when one is due (evaluation.py), on the least loaded worker."""
        worker = self.least_loaded_worker() if self.evaluator.every > 0 else None
        if worker is not None:
            client = self.clients[worker] if self.router is None else self.router.for_group(-1 - self.evaluator.num_evals)
            if isinstance(self.weights, SGLangLoraCoordinator):  # the served adapters, as the groups' requests
                client = AdapterClient(client, self.weights)
            self.evaluator.maybe_start(client, self.version)

    def current_weights(self) -> tuple[int, Optional[str]]:
        d = self.paths.weights(self.version)
        return self.version, (str(d) if d.is_dir() else None)


    def launch_groups(self) -> None:
        o = self.cfg.orchestrator
        want = groups_to_launch(next_step=self.next_step, weight_version=self.version, max_off=o.max_off_policy_steps,
                                groups_per_step=o.num_prompts_per_step, buffered_usable=self.buffer.usable(self.next_step),
                                inflight_groups=len(self.inflight), spare=o.num_spare_groups)
        while self.retry and (worker := self.least_loaded_worker()) is not None:  # same ids, another worker
            gid, env_task, why = self.retry.popleft()
            self.ledger.resubmit(gid, worker, why)
            self.start_group(worker, gid, env_task)
        room = (o.max_inflight_rollouts - len(self.inflight) * self.group_size) // self.group_size
        for _ in range(max(0, min(want, room))):
            worker = self.least_loaded_worker()
            if worker is None:
                return
            env_task = self.env.sample_task()
            self.ledger.launch(self.next_group_id, env_task.task_id, worker)
            self.start_group(worker, self.next_group_id, env_task)
            self.next_group_id += 1

    def make_clients(self, token: str, session: aiohttp.ClientSession, timeout: float
                     ) -> tuple[list[InferenceClient], Optional[Any]]:
        """One client per server (admin, readiness); with a router (SGLang: smg) also its generation client.

        A backend whose /get_model_info lacks the routing shape (SGLang's) gets it from cfg.model.
        """
        m, backend = self.cfg.model, BACKENDS.get(self.cfg.inference.backend)
        shape = (None, None, None) if backend.reports_routing_shape else (m.num_routed_layers, m.top_k, m.num_experts)
        clients = [InferenceClient(u, token, session=session, timeout_s=timeout, num_layers=shape[0], top_k=shape[1],
                                   num_experts=shape[2]) for u in self.topo.inference_urls]
        router = None
        if backend.make_router is not None and self.topo.router_url:
            router = backend.make_router(self.cfg, self.topo.router_url, token, session=session, timeout_s=timeout,
                                         shape=shape, topology=self.topo)
        return clients, router

    def generation_client(self, worker: int, gid: int) -> InferenceClient:
        """The router, keyed by the group so all its turns reuse one server's prefix cache; else the worker.
        LoRA mode on SGLang: requests carry the adapter that is served now (lora_coordinator.AdapterClient)."""
        client = self.clients[worker] if self.router is None else self.router.for_group(gid)
        return AdapterClient(client, self.weights) if isinstance(self.weights, SGLangLoraCoordinator) else client

    def start_group(self, worker: int, gid: int, env_task) -> None:
        o = self.cfg.orchestrator
        routed = o.return_routed_experts and self.cfg.model.num_experts > 0  # a dense model routes nothing
        env, inner = self.env.resolve(env_task)  # env=mix: the entry's env and its task
        self.rate.start()  # the first request after readiness: inference_tokens_per_s counts from here
        # episodes.py, for every env: turns, tools, sandbox (+ simulated latency per env step)
        task = asyncio.create_task(run_episode_group(  # several adapters: requests name the group's
            client_for(self.generation_client(worker, gid), env_task, self.adapters), env, inner, group_id=gid,
            worker=worker,
            num_samples=self.group_size, temperature=o.temperature, return_routed_experts=routed,
            started_version=self.version, meter=self.meter, latency=self.latency,
            env_tag=getattr(env_task, "label", None)))
        self.inflight[task] = worker
        self.group_of[task] = (gid, env_task)

    def least_loaded_worker(self) -> Optional[int]:
        """The live worker with the fewest groups in flight (None: every worker is down)."""
        live = self.pool.live() if self.pool is not None else list(range(len(self.clients)))
        if isinstance(self.weights, LoraCoordinator):  # never a worker serving an adapter it did not confirm
            live = [w for w in live if self.weights.samples_from(w)]
        if not live:
            return None
        load = {w: 0 for w in live}
        for w in self.inflight.values():
            if w in load:
                load[w] += 1
        return min(live, key=load.__getitem__)

    async def collect_finished(self, *, timeout_s: float) -> None:
        if not self.inflight:
            await asyncio.sleep(timeout_s)
            return
        done, _ = await asyncio.wait(self.inflight, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            worker = self.inflight.pop(task)
            gid, env_task = self.group_of.pop(task)
            try:
                group: RolloutGroup = task.result()  # a failed request raises here with the worker's URL
            except (InferenceError, asyncio.CancelledError) as e:  # worker died or was marked dead: run it elsewhere
                reason = str(e) or "cancelled: worker marked dead"
                self.pool.request_failed(worker, e)
                self.retry.append((gid, env_task, reason))
                continue
            if isinstance(self.weights, LoraCoordinator) and any(
                    self.weights.refuses(worker, s.token_versions) for s in group.samples):
                self.dropped_unconfirmed += len(group.samples)
                self.log.error("dropped group %d from worker %d: sampled under an adapter version it never confirmed",
                               gid, worker)
                self.ledger.drop([gid])
                continue
            self.group_done_at[gid] = now()
            group.adapter = adapter_of(env_task, self.adapters)
            self.rate.add(sum(len(s.completion_ids) for s in group.samples))
            group.max_model_tokens = max_model_tokens(self.env.resolve(env_task)[0].limits)
            if self.scorers:  # reference / teacher log-probs of the sampled tokens, beside the event loop
                await asyncio.to_thread(self.scorers.apply, group)
            if not self.buffer.add(group):  # dynamic sampling dropped it (zero reward variance): draw another
                self.ledger.drop([gid])


def max_model_tokens(limits) -> int:
    """The L of overlong shaping: the most model tokens an episode under ``limits`` may generate."""
    return min(limits.max_new_tokens_per_turn * limits.max_turns, limits.max_episode_tokens)


def run_orchestrator(cfg: RunConfig, topo: Topology) -> None:
    try:
        asyncio.run(Orchestrator(cfg, topo).run())
    except (RewardsFailing, AdapterNotDelivered) as e:  # the user's error, or adapters that reach no worker: one clear line, and an exit code that is not restarted
        get_logger("orchestrator", 0).error("stopping the run: %s", e)
        print(f"slurmrl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
