"""Event logic of the simulator against hand-computed cases (tools/simulator/engine.py, system.py).

Every expected number below is worked out by hand in the test's docstring: the servers'
processor sharing, pauses, CPU sharing, and the orchestrator's launch/staleness rules
(the real groups_to_launch and RolloutBuffer) for two rollouts of known lengths, sync
versus async.
"""
from __future__ import annotations

import math

import pytest

from tools.simulator.costs import Replica
from tools.simulator.engine import CpuPool, Job, ShareServer, Sim, StepServer
from tools.simulator.layout import Layout
from tools.simulator.system import LoopConfig, System
from tools.simulator.workload import RolloutShape, Segment


def finish_times(sim: Sim, server, sizes, **kw) -> list[float]:
    done: list[float] = []
    for s in sizes:
        server.submit(Job(s, lambda job: done.append(round(sim.now, 9)), **kw))
    sim.run(lambda: False)
    return done


def test_decode_shares_iterations_between_sequences():
    """step_s(n) = 0.1 n: 2 sequences advance 5 tokens/s each; the 3-token one ends at 0.6, the
    other then runs alone at 10 tokens/s for its last 2 tokens: 0.6 + 0.2 = 0.8."""
    sim = Sim()
    server = StepServer(sim, "d", lambda n, ctx: 0.1 * n, max_running=8)
    assert finish_times(sim, server, [3, 5]) == [0.6, 0.8]


def test_decode_admission_is_fifo_when_full():
    """One slot, 0.1 s per iteration: 3 tokens end at 0.3, the queued 5 tokens at 0.3 + 0.5."""
    sim = Sim()
    server = StepServer(sim, "d", lambda n, ctx: 0.1, max_running=1)
    assert finish_times(sim, server, [3, 5]) == [0.3, 0.8]


def test_kv_capacity_holds_back_a_request():
    """KV room 10 tokens: ctx 2 + 3 new fits, a second ctx 2 + 6 would need 13 > 10 and waits."""
    sim = Sim()
    server = StepServer(sim, "d", lambda n, ctx: 0.1, max_running=8, kv_tokens=10)
    assert finish_times(sim, server, [3, 6], ctx=2) == [0.3, 0.9]


def test_pause_freezes_decoding_in_place():
    """5 tokens at 0.1 s each, paused from 0.2 to 1.2: done at 0.5 + 1.0 = 1.5."""
    sim = Sim()
    server = StepServer(sim, "d", lambda n, ctx: 0.1, max_running=8)
    done = []
    server.submit(Job(5, lambda job: done.append(sim.now)))
    sim.at(0.2, server.pause)
    sim.at(1.2, server.resume)
    sim.run(lambda: False)
    assert done == [pytest.approx(1.5)]


def test_prefill_stall_delays_the_batch_once():
    """Two requests admitted together pay one prefill stall of 0.25 s, then 2 tokens at 0.1 s."""
    sim = Sim()
    server = StepServer(sim, "u", lambda n, ctx: 0.1, max_running=8, prefill_s=lambda k, tokens: 0.25)
    assert finish_times(sim, server, [2, 2]) == [0.45, 0.45]


def test_share_server_splits_capacity():
    """1 work/s shared: jobs of 1 and 3 run at 0.5/s until 2.0; the rest (2) alone: 4.0."""
    sim = Sim()
    assert finish_times(sim, ShareServer(sim, "p", 1.0), [1, 3]) == [2.0, 4.0]


@pytest.mark.parametrize("cores,expected", [(1, 2.0), (2, 1.0)])
def test_cpu_pool_slows_concurrent_processes(cores, expected):
    """Two processes each needing 1 s of CPU: on 1 core both end at 2 s, on 2 cores at 1 s."""
    sim, pool = Sim(), CpuPool(cores)
    servers = [ShareServer(sim, f"s{i}", 1.0) for i in range(2)]
    done = []
    for s in servers:
        pool.join(s)
        s.submit(Job(1.0, lambda job: done.append(sim.now)))
    sim.run(lambda: False)
    assert done == [pytest.approx(expected)] * 2


class FixedCosts:
    """0.1 s per decode iteration whatever the batch, no prefill cost, 1 s per trainer step."""

    cpu_cores = None
    orch_poll_s = trainer_poll_s = 0.0

    def decode_step_s(self, r, n, ctx):
        return 0.1

    def unified_prefill_s(self, r, k, tokens):
        return 0.0

    def max_running(self, r):
        return 64

    def kv_capacity_tokens(self, r, gpu_gb):
        return math.inf

    def kv_transfer_s(self, ctx):
        return 0.0

    def train_s(self, lengths):
        return 1.0

    def train_sleep_s(self):
        return 0.0

    def weight_sync(self, replicas, transport, *, delta_fraction=0.0):
        return 0.0, 0.0


class ListWorkload:
    """Group k gets rollouts of ``lengths[k]`` decode tokens (the last list repeats)."""

    def __init__(self, lengths):
        self.lengths, self.k = lengths, 0

    def group(self, rng, size):
        tokens = self.lengths[min(self.k, len(self.lengths) - 1)]
        self.k += 1
        return [RolloutShape(start_s=0.0, segments=[Segment(1, 0, n, 0.0)], total_tokens=n + 1, completion_tokens=n)
                for n in tokens]


def run_system(lengths, *, max_off: int, steps: int = 4) -> System:
    layout = Layout(replicas=(Replica(kind="unified", index=0, num_gpus=0, num_nodes=1),), trainer_gpus=0,
                    trainer_nodes=1, gpu_nodes=0)
    loop = LoopConfig(groups_per_step=1, group_size=len(lengths[0]), max_off_policy_steps=max_off,
                      max_inflight_rollouts=64, num_steps=steps, warmup_steps=1)
    system = System(Sim(), FixedCosts(), layout, ListWorkload(lengths), loop)
    system.run()
    return system


def test_sync_two_rollouts_exact_step_times():
    """max_off=0: rollouts of 3 and 5 tokens take 0.5 s together, then the trainer 1 s, then the
    next group starts: steps end at 1.5, 3.0, 4.5, 6.0 (period 1.5 s, trainer idle 1/3)."""
    system = run_system([[3, 5]], max_off=0)
    assert system.step_end == pytest.approx([1.5, 3.0, 4.5, 6.0])
    s = system.summary()
    assert s["step_s"] == pytest.approx(1.5)
    assert s["trainer_idle_frac"] == pytest.approx(1 / 3)
    assert s["samples_dropped_frac"] == 0


def test_async_two_rollouts_exact_step_times():
    """max_off=1: two groups start at 0 (groups_to_launch: steps 0 and 1), both done at 0.5;
    each publish launches one more group that is ready before the trainer is: steps end at
    1.5, 2.5, 3.5, 4.5 (period 1.0 s = the trainer, idle 0 after warm-up)."""
    system = run_system([[3, 5]], max_off=1)
    assert system.step_end == pytest.approx([1.5, 2.5, 3.5, 4.5])
    s = system.summary()
    assert s["step_s"] == pytest.approx(1.0)
    assert s["trainer_idle_frac"] == pytest.approx(0.0, abs=1e-9)
    assert [g.policy_version for g in system.used_groups] == [0, 0, 1, 2]


def test_stale_group_is_dropped_and_replaced():
    """max_off=1, one sample per group: group 0 needs 3.0 s, the others 0.1 s. Batches 0-2 come
    from groups 1-3 (steps end 1.1, 2.2, 3.3); group 0 (version 0) finishes at 3.0, when the
    next batch is step 3: 3 - 0 > 1, so the buffer drops it and a fresh group fills step 3,
    which trains 3.3-4.3."""
    system = run_system([[30], [1]], max_off=1)
    assert system.step_end == pytest.approx([1.1, 2.2, 3.3, 4.3])
    assert system.buffer.dropped_samples_total == 1
    assert [g.group_id for g in system.used_groups] == [1, 2, 3, 4]


def test_spare_group_runs_alongside_and_goes_stale_in_sync_mode():
    """max_off=0 with one spare group: each version launches 2 groups, both done 0.5 s later; the
    batch takes the first, the spare is stale at the next step and dropped (2 samples per step).
    Step times are the plain sync ones: 1.5, 3.0, 4.5, 6.0."""
    layout = Layout(replicas=(Replica(kind="unified", index=0, num_gpus=0, num_nodes=1),), trainer_gpus=0,
                    trainer_nodes=1, gpu_nodes=0)
    loop = LoopConfig(groups_per_step=1, group_size=2, max_off_policy_steps=0, max_inflight_rollouts=64, num_steps=4,
                      warmup_steps=1, num_spare_groups=1)
    system = System(Sim(), FixedCosts(), layout, ListWorkload([[3, 5]]), loop)
    system.run()
    assert system.step_end == pytest.approx([1.5, 3.0, 4.5, 6.0])
    assert system.buffer.dropped_samples_total == 6
