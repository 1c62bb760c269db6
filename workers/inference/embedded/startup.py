"""Boot of an embedded worker: wait for published weights, load the newest VALID step.

Why not simply the newest: a worker restarted after a crash (or started late) may find the
newest step corrupt (a bad disk block, a truncated shard, NaN weights that slipped in), and
retrying only that step crash-loops the worker through all its restarts while an intact
earlier step sits next to it. So :func:`build_engine` tries the published steps newest
first and falls back to earlier ones, logging each step it skipped and why (the checksum,
finiteness or file check that failed: weights.filesystem.DiskReader). The orchestrator then
moves the worker to its current version before sending work (orchestrator/faults.py); a
refused update there keeps the step loaded here. Steps pruned by retention between listing
and loading are simply skipped too; the listing is retried a few times, since newer steps
may appear meanwhile.

When no published step loads at all (a respawned worker finds only steps it refuses: a damaged patch chain
while the trainer writes a full step to replace it), the worker does not exit at once, which used up its
restarts while the other workers were healthy: it waits for a step it has not refused yet (a newer one, or
one written again) up to ``inference.startup_timeout_s``, then exits naming every refusal.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from workers.common.protocol import STABLE, WEIGHTS_DIR, RunPaths, is_marked, step_name, wait_for
from workers.common.dtypes import FLOAT8, held_dtype
from workers.common.registry import TRANSPORTS
from workers.inference.embedded.fp8 import quantize_for_serving
from workers.inference.embedded.lora import EngineLora
from workers.inference.embedded.param_arena import pack_parameters
from workers.inference.embedded.static_engine import create_engine
from workers.inference.embedded.engine import InferenceEngine, engine_seed
from workers.models.build import model_from_config
from workers.weights.base import WeightLoadError
from workers.weights.lora_steps import BASE_STEP, lora_mode
from workers.weights.filesystem.reanchor import stable_mark

log = logging.getLogger("slurmrl.inference")
LIST_ROUNDS = 3


def stable_steps(weights_root: Path) -> list[tuple[int, Path]]:
    """Published steps (``step_N`` with STABLE) as (N, dir), newest first; other names are ignored."""
    try:
        entries = list(Path(weights_root).iterdir())
    except OSError:
        return []
    steps = [(int(d.name[5:]), d) for d in entries if d.name.startswith("step_") and d.name[5:].isdigit()
             and is_marked(d)]
    return sorted(steps, reverse=True)


def load_newest_valid(engine: InferenceEngine, paths: RunPaths, *, wait_s: float = 0.0, poll_s: float = 0.5) -> int:
    """Load the newest intact published step into ``engine``; returns it. None intact: wait up to ``wait_s``
    for a step not refused yet (a new one, or one written again: its STABLE marker changed), then
    WeightLoadError listing every step refused and why."""
    weights_root = paths.root / WEIGHTS_DIR
    refused: dict[int, tuple[object, str]] = {}  # step -> (its STABLE marker when refused, why)
    if engine.lora is not None:  # LoRA mode: the frozen base first (step 0), then the newest adapter on it
        base = weights_root / step_name(BASE_STEP)
        wait_for(lambda: is_marked(base), timeout_s=60.0, what=f"the LoRA base {base}/{STABLE}", peer="trainer rank 0")
        engine.update_weights_from_disk(str(base), BASE_STEP)
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        for _ in range(LIST_ROUNDS):
            for step, step_dir in stable_steps(weights_root):
                mark = stable_mark(weights_root, step)  # written again (an anchor out of turn): tried again
                if step in refused and refused[step][0] == mark:
                    continue
                if engine.lora is not None and step == BASE_STEP:
                    return step  # loaded above
                try:
                    engine.update_weights_from_disk(str(step_dir), step)
                except (WeightLoadError, OSError) as e:
                    refused[step] = (mark, str(e)[:500])
                    log.warning("skipping weights step %d: %s", step, refused[step][1])
                    continue
                if refused:
                    log.warning("loaded weights step %d; skipped newer steps %s (see above)", step,
                                sorted(s for s in refused if s > step))
                return step
        if time.monotonic() >= deadline:
            break
        if not waiting:
            waiting = True
            log.warning("no published weights step loads (%d refused): waiting up to %.0fs for the next one "
                        "(inference.startup_timeout_s)", len(refused), wait_s)
        time.sleep(poll_s)
    reasons = "; ".join(f"step {s}: {r}" for s, (_, r) in sorted(refused.items(), reverse=True)[:5])
    raise WeightLoadError(f"no intact published weights step in {weights_root} ({len(refused)} refused: "
                          f"{reasons or 'none listed'})")


def build_engine(cfg, rank: int, run_dir: str) -> InferenceEngine:
    """Model skeleton from ``cfg.model``, then wait for any STABLE step (deadline
    ``inference.startup_timeout_s``) and load the newest intact one as its version."""
    paths = RunPaths(run_dir)
    model = model_from_config(cfg.model, held_dtype(cfg.inference.dtype), cfg.inference.device)
    if cfg.inference.dtype == FLOAT8:
        quantize_for_serving(model)
    else:  # one storage per dtype: a patch is staged as one group (param_arena.py says why not for fp8)
        pack_parameters(model)
    weights_root = paths.root / WEIGHTS_DIR
    wait_for(lambda: bool(stable_steps(weights_root)), timeout_s=cfg.inference.startup_timeout_s,
             what=f"initial weights {weights_root}/step_*/{STABLE}", peer="trainer rank 0")
    mode = lora_mode(cfg)
    lora = None if mode is None else EngineLora(model, rank=mode.rank, targets=mode.targets,
                                                num_adapters=len(mode.adapters), names=mode.adapters)
    engine = create_engine(model, max_batch_size=cfg.inference.max_batch_size, seed=engine_seed(cfg.seed, rank),
                           options=cfg.inference, lora=lora)
    device = next(model.parameters()).device  # the transport's receiver: the one reader of every update
    engine.receiver_for(cfg.weights, lambda: TRANSPORTS.get(cfg.weights.transport).receiver(cfg.weights, device=device))
    load_newest_valid(engine, paths, wait_s=cfg.inference.startup_timeout_s)
    check = getattr(model, "self_check", None)  # the generic path: our head against transformers' forward
    if check is not None:
        log.info("logits agree with transformers' own forward (relative difference %.2e)", check())
    return engine
