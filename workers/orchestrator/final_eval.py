"""The final weights are evaluated too (``orchestrator.eval_every_steps`` > 0).

In-run evaluations report through the next batch's record (evaluation.py), so the weights of the
last step, published after the last batch was trained, would never be scored. After writing its
last batch the orchestrator therefore waits (up to ``orchestrator.weight_update_timeout_s``) for
the trainer to publish step ``trainer.num_steps`` and to finish (``TRAINER_DONE``: it has closed
metrics.jsonl), loads those weights into the inference workers, evaluates them, and appends one
record to metrics.jsonl::

    {"step": N, "time": ..., "final_eval": true, "eval/reward": ..., "eval/weights_step": N, ...}

TensorBoard gets its ``eval/*`` scalars at step N (the same grouped tags); the console prints it as
the eval line of step N. An eval of earlier weights still running when the last batch was written
is awaited and recorded the same way. Failing to reach the final weights is a warning, not an error:
training is done.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any


async def evaluate_final_weights(orch: Any) -> None:
    """``orch``: the Orchestrator (loop.py) whose loop has written every batch."""
    ev, n = orch.evaluator, orch.cfg.trainer.num_steps
    if ev.every <= 0:
        return
    deadline = time.monotonic() + orch.cfg.orchestrator.weight_update_timeout_s
    results = []
    if ev.task is not None:  # an earlier eval still running: its result has no batch left to ride on
        await asyncio.wait([ev.task], timeout=max(deadline - time.monotonic(), 0.0))
        results.append(ev.take_result())
    while orch.version < n and time.monotonic() < deadline:
        await orch.maybe_update_weights()
        if orch.version < n:
            await asyncio.sleep(0.2)
    if orch.version < n:
        orch.log.warning("final weights (step %d) not evaluated: the inference workers hold step %d after %.0fs "
                         "(orchestrator.weight_update_timeout_s)", n, orch.version,
                         orch.cfg.orchestrator.weight_update_timeout_s)
    elif ev.last_version != n:
        worker = orch.least_loaded_worker()
        if worker is not None:
            client = orch.clients[worker] if orch.router is None else orch.router.for_group(-1 - ev.num_evals)
            ev.last_version = n
            try:
                results.append(await asyncio.wait_for(ev.run(client, n), max(deadline - time.monotonic(), 1.0)))
            except Exception as e:  # training is done: say why the final eval is missing, never fail the run
                orch.log.warning("final weights (step %d) not evaluated: %s: %s", n, type(e).__name__, e)
    results = [r for r in results if r]
    if results:
        write_records(orch, n, results, deadline)


def write_records(orch: Any, n: int, results: list[dict], deadline: float) -> None:
    """Append the eval records once the trainer closed metrics.jsonl (TRAINER_DONE)."""
    while not orch.paths.trainer_done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not orch.paths.trainer_done.exists():
        orch.log.warning("final eval results not written: the trainer did not finish (no %s)", orch.paths.trainer_done)
        return
    from workers.common.metrics import MetricsWriter  # TensorBoard (torch) only here, once

    writer = MetricsWriter(orch.paths)
    try:
        for result in results:
            writer.write({"step": n, "time": time.time(), "final_eval": True, **result})
    finally:
        writer.close()
    orch.log.info("final eval: reward %.3f at the weights of step %s", results[-1].get("eval/reward", float("nan")),
                  results[-1].get("eval/weights_step"))
