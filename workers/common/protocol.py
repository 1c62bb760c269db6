"""File protocol between roles: where things live in run_dir and how they appear atomically.

Who writes what (every wait has a deadline that names the peer):

- launcher      -> ``config/run.yaml`` (resolved config), ``admin_token`` (mode 600).
- trainer ranks -> ``weights/step_N/`` (N = number of optimizer steps taken; step_0 is the
  initial model): one safetensors shard per trainer rank, ``index.json`` (rank 0: file, shape,
  dtype, xxh3 per tensor; delta steps point unchanged tensors at older steps) and ``STABLE``
  written last (workers/weights/filesystem/). The directory is first written as
  ``.step_N.tmp`` and renamed, so a reader that sees ``step_N/STABLE`` sees complete files.
  With ``weights.transport=broadcast`` only step_0 goes through here; later versions travel
  over the weight group (workers/weights/broadcast/, its handshake.py markers).
- orchestrator  -> ``rollouts/step_N/`` = ``batch.safetensors`` (tensors below) + ``meta.json``
  + ``READY`` last, same temp-dir-then-rename rule. Batch N trains step N.
- trainer rank0 -> ``metrics.jsonl`` (one JSON object per step), ``tb/`` TensorBoard events.
- orchestrator  -> ``orchestrator_state.json`` (progress), ``DONE`` when it finished,
  ``orchestrator_ledger.jsonl`` (every group's launch/resubmit/batch/drop: ledger.py).
- trainer ranks -> ``checkpoints/step_N/`` (model, optimizer, RNG per rank) + ``COMPLETE`` last.
- orchestrator  -> ``inference_health.json`` (dead workers; the supervisors kill hung ones).

Batch tensors (row = one sample, right-padded to T; token t is predicted from tokens < t):
  input_ids int64[B,T], attention_mask uint8[B,T], loss_mask uint8[B,T] (completion tokens),
  inference_logprobs float32[B,T] (0 outside loss_mask), advantages float32[B] or [B,T],
  rewards float32[B], token_versions int32[B,T] (policy version that sampled each token,
  -1 on prompt/pad), routed_experts uint8|uint16[B,T,L,k] (optional; row t = experts used
  when token t was the *input*; rows the engine did not report are 0 and flagged 0 in
  routed_mask uint8[B,T]), ref_logprobs float32[B,T] (optional: the step-0 policy's log-probs of
  the loss tokens, for trainer.kl_coef; workers/orchestrator/scoring.py).
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Optional

WEIGHTS_DIR = "weights"
ROLLOUTS_DIR = "rollouts"
STABLE = "STABLE"
READY = "READY"
METRICS_FILE = "metrics.jsonl"
ADMIN_TOKEN_FILE = "admin_token"
ORCH_DONE = "DONE"
USER_ERROR_EXIT = 78  # sysexits EX_CONFIG; a role stopped on the user's error (every reward failing): restarting cannot help
TRAINER_DONE = "TRAINER_DONE"
"""Written by the trainer after its last step (json: time, num_steps)."""
LEDGER_FILE = "orchestrator_ledger.jsonl"  # rollout ledger (workers/orchestrator/ledger.py)
CHECKPOINTS_DIR = "checkpoints"  # trainer checkpoints step_N/ + COMPLETE (workers/trainer/checkpoint.py)
COMPLETE = "COMPLETE"
INFERENCE_HEALTH = "inference_health.json"
"""Orchestrator -> supervisors: the inference workers marked dead, since when, and the kill bound
(workers/orchestrator/faults.py WorkerPool.write_health; launcher/hung.py reads it)."""


class PeerTimeout(TimeoutError):
    """A wait ran past its deadline; the message names the peer and what it waited for."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


class RunPaths:
    """Paths of one run directory. Pure path arithmetic, no I/O except ``ensure``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir).resolve()

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def run_config(self) -> Path:
        return self.config_dir / "run.yaml"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def admin_token(self) -> Path:
        return self.root / ADMIN_TOKEN_FILE

    @property
    def tb_dir(self) -> Path:
        return self.root / "tb"

    def weights(self, step: int) -> Path:
        return self.root / WEIGHTS_DIR / step_name(step)

    def rollouts(self, step: int) -> Path:
        return self.root / ROLLOUTS_DIR / step_name(step)

    @property
    def orchestrator_done(self) -> Path:
        return self.root / ORCH_DONE

    @property
    def trainer_done(self) -> Path:
        return self.root / TRAINER_DONE

    def ensure(self) -> "RunPaths":
        for d in (self.config_dir, self.logs_dir, self.root / WEIGHTS_DIR, self.root / ROLLOUTS_DIR):
            d.mkdir(parents=True, exist_ok=True)
        return self


def is_marked(step_dir: Path, marker: str = STABLE) -> bool:
    """``step_dir/marker`` is a regular file (not followed through a symlink): a directory, FIFO or
    link named STABLE was not written by a publisher and vouches for nothing."""
    try:
        return stat.S_ISREG(os.lstat(Path(step_dir) / marker).st_mode)
    except (OSError, ValueError):
        return False


def latest_stable_step(weights_root: Path) -> Optional[int]:
    """Highest N with ``step_N/STABLE`` present (a regular file), or None."""
    best = None
    if not weights_root.is_dir():
        return None
    for d in weights_root.iterdir():
        if d.name.startswith("step_") and d.name[5:].isdigit() and is_marked(d):
            n = int(d.name[5:])
            best = n if best is None or n > best else best
    return best


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


#: How often the trainer looks for its next batch (a stat of READY: microseconds). The batch hand-off
#: waits half of it on average when the trainer is the one waiting (timeline phase ``handoff``: 20 ms
#: measured 11 ms median on a synchronous CPU run).
BATCH_POLL_S = 0.002


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, peer: str, poll_s: float = 0.05,
             alive: Optional[Callable[[], bool]] = None) -> Any:
    """Poll ``predicate`` until truthy; raise PeerTimeout naming ``peer`` after ``timeout_s``.

    ``alive`` (optional) is checked each poll; returning False aborts early (e.g. stop flag).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None and not alive():
            raise PeerTimeout(f"stopped while waiting for {what} from {peer}")
        if time.monotonic() > deadline:
            raise PeerTimeout(f"waited {timeout_s:.0f}s for {what} from {peer}; is the {peer} alive? see its log")
        time.sleep(poll_s)


def read_admin_token(paths: RunPaths) -> str:
    return paths.admin_token.read_text().strip()
