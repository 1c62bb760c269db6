"""``slurmrl-eval STEP_DIR``: evaluate one published step on its own, outside a training run.

    slurmrl-eval runs/latest/weights/step_000020 --num-samples 64 --k 4 --out eval_20.json

What it does, with the same pieces a run uses (the protocol between them unchanged):
  1. reads the run's resolved config (``<run_dir>/config/run.yaml``, run_dir = STEP_DIR/../..);
  2. makes a scratch run directory whose ``weights/`` holds only this step (a link; a patch step of
     ``weights.delta`` brings its anchor and the patches in between), with its own admin token, and
     starts one embedded inference server on it (``python -m workers.inference``, the role process
     the launcher starts): it loads the newest stable step there, i.e. STEP_DIR. A step it cannot
     load (damaged, a link of its chain missing) fails at once, naming why: the chain is checked
     before the server starts, a server that exits is noticed at once, and one that fell back to an
     older step of the chain is refused;
  3. runs the orchestrator's evaluation (evaluation.py ``Evaluator.run``: the env's eval split,
     one greedy answer per record or ``--k`` sampled ones) through an InferenceClient over HTTP;
  4. prints the eval/* metrics as JSON (and writes them to ``--out``), stops the server (SIGTERM,
     then kill after a deadline) and removes the scratch directory (its admin token with it), also
     when the tool itself gets SIGTERM or SIGINT.

The step is served by the embedded engine whatever ``inference.backend`` the run used, so this
evaluates what the embedded engine can hold (CPU, one GPU). Every built-in env has an eval split
(generated envs: a fixed-seed set, envs/base.py GeneratedEvalSplit; env=dataset: env.eval_path or
env.eval_fraction); an env without one, or a reward module not on PYTHONPATH, is refused with one
``slurmrl-eval: error:`` line before anything starts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import aiohttp
from omegaconf import OmegaConf

from workers.common.config import load_run_config, structure_section, to_yaml
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.orchestrator.adapters import trained_adapters
from workers.common.ports import free_port
from workers.common.logs import get_logger
from workers.common.protocol import WEIGHTS_DIR, RunPaths, is_marked
from workers.common.registry import ENVS
from workers.orchestrator.envs import make_env
from workers.orchestrator.evaluation import Evaluator
from workers.weights.filesystem.layout import referenced_steps

STOP_GRACE_S = 15.0


SCRATCH: list[Path] = []  # scratch run dirs made by this process (each holds an admin token): removed on exit


class EvalError(ValueError):
    """A bad STEP_DIR or a run that cannot be evaluated; the message says which and why."""


class Stopped(BaseException):
    """SIGTERM/SIGINT: unwinds through evaluate()'s cleanup (server stopped, scratch dir removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the cleanup that follows is not interrupted again
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def locate(step_dir: Path) -> tuple[Path, int]:
    """(run_dir, step) of a published ``weights/step_N`` directory."""
    step_dir = step_dir.resolve()
    if not step_dir.is_dir() or not step_dir.name.startswith("step_") or not step_dir.name[5:].isdigit():
        raise EvalError(f"{step_dir} is not a published step directory (weights/step_N)")
    if not is_marked(step_dir):
        raise EvalError(f"{step_dir} has no STABLE marker: the step was not completely published")
    run_dir = step_dir.parent.parent
    if not RunPaths(run_dir).run_config.exists():
        raise EvalError(f"{RunPaths(run_dir).run_config} is missing: {step_dir} is not inside a run directory")
    return run_dir, int(step_dir.name[5:])


def chain_of(step_dir: Path) -> list[Path]:
    """The step dirs a worker reads to load ``step_dir``: itself, and for a patch step its anchor and every
    patch in between (layout.referenced_steps); EvalError naming the first one missing or unpublished."""
    wanted = sorted(referenced_steps(step_dir))
    for name in wanted:
        if not is_marked(step_dir.parent / name):
            raise EvalError(f"{step_dir} is a patch step whose chain needs {step_dir.parent / name}, which is missing "
                            f"or not completely published (retention pruned it, or it was deleted)")
    return [step_dir.parent / name for name in wanted] + [step_dir]


def scratch_run(run_dir: Path, step_dir: Path, cfg) -> RunPaths:
    """A run directory holding only this step (and its chain), the run's config (served by the embedded engine)
    and a token."""
    chain = chain_of(step_dir.resolve())
    paths = RunPaths(Path(tempfile.mkdtemp(prefix="slurmrl-eval-")))
    SCRATCH.append(paths.root)
    paths.ensure()
    if cfg.inference.backend != "embedded":  # serve the step with the embedded engine, its defaults
        cfg.inference = OmegaConf.to_object(structure_section("inference", {"backend": "embedded"}))
    paths.run_config.write_text(to_yaml(cfg))
    fd = os.open(paths.admin_token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    paths.weights(0).parent.mkdir(parents=True, exist_ok=True)
    for d in chain:
        os.symlink(d, paths.root / WEIGHTS_DIR / d.name)
    return paths


async def ready_or_refused(client: InferenceClient, proc: subprocess.Popen, paths: RunPaths, step: int,
                           deadline_s: float) -> None:
    """Wait for the server; EvalError at once when it exits first or serves another step than ``step``
    (it refused ours and fell back to an older one of the chain), with the reason from its log."""
    ready = asyncio.ensure_future(wait_until_ready([client], deadline_s))
    try:
        while not ready.done():
            if why := _skipped(paths, step):  # a server with no loadable step waits for a newer one: not here
                raise EvalError(f"the inference server refused step {step}: {why}")
            if proc.poll() is not None:
                raise EvalError(f"the inference server stopped (exit {proc.returncode}) before it served step {step}: "
                                f"{_refusal(paths, step)}")
            await asyncio.wait({ready}, timeout=0.2)
        ready.result()
    finally:
        ready.cancel()
    served = int((await client.get_model_info()).get("weight_version", -1))
    if served != step:
        raise EvalError(f"the inference server refused step {step} (it loaded step {served}): {_refusal(paths, step)}")


def _skipped(paths: RunPaths, step: int) -> str:
    """The server log's reason for refusing ``step`` ("" if it did not: startup.py logs each step it skips)."""
    try:
        text = (paths.logs_dir / "inference_0.log").read_text(errors="replace")
    except OSError:
        return ""
    why = [ln.split(f"skipping weights step {step}: ", 1)[1] for ln in text.splitlines()
           if f"skipping weights step {step}: " in ln]
    return why[-1][:600] if why else ""


def _refusal(paths: RunPaths, step: int) -> str:
    """Why the server did not serve ``step``: its refusal, else the last line of its log."""
    if why := _skipped(paths, step):
        return why
    try:
        lines = (paths.logs_dir / "inference_0.log").read_text(errors="replace").splitlines()
    except OSError:
        return "see its log"
    return lines[-1][:600] if lines else "its log is empty"


def start_server(paths: RunPaths, url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE"))}
    env.update(SLURMRL_ROLE="inference", SLURMRL_RUN_DIR=str(paths.root), SLURMRL_LOCAL="1", RANK="0",
               SLURMRL_RANK="0", WORLD_SIZE="1", SLURMRL_INFERENCE_URLS=url, SLURMRL_BIND_HOST="127.0.0.1",
               PYTHONUNBUFFERED="1")
    log = open(paths.logs_dir / "inference_0.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "workers.inference"], env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def evaluate(step_dir: Path, *, num_samples: Optional[int] = None, k: Optional[int] = None,
                   timeout_s: float = 600.0) -> dict:
    """The eval/* metrics of the step at STEP_DIR (module docstring: how)."""
    run_dir, step = locate(step_dir)
    cfg = load_run_config(str(RunPaths(run_dir).run_config))
    if not ENVS.get(cfg.env.name).eval_split:
        raise EvalError(f"env={cfg.env.name} has no eval split: its env class needs eval_tasks(n) (every built-in "
                        f"env has one; env=dataset needs env.eval_path or env.eval_fraction)")
    o = cfg.orchestrator
    log = get_logger("eval", 0)
    try:
        env = make_env(cfg.env, seed=cfg.seed, model=cfg.model)
    except ValueError as e:  # the run's data or reward module cannot be loaded from here
        hint = (" (the reward module is imported from PYTHONPATH: set it as the run had it, e.g. "
                "PYTHONPATH=/path/to/your/module/dir slurmrl-eval ...)" if "import" in str(e) else "")
        raise EvalError(f"the run's env={cfg.env.name} cannot be made here: {e}{hint}") from None
    if cfg.env.name == "dataset" and not env.eval_tasks(1):
        raise EvalError("the run's env=dataset has no eval split: it set neither env.eval_path nor env.eval_fraction")
    evaluator = Evaluator(env, every=1, num_samples=num_samples or o.eval_num_samples, log=log, k=k or o.eval_k,
                          temperature=o.temperature, success_reward=o.eval_success_reward,
                          adapters=trained_adapters(cfg))
    paths = scratch_run(run_dir, step_dir, cfg)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    proc: Optional[subprocess.Popen] = None
    try:
        proc = start_server(paths, url)
        async with aiohttp.ClientSession() as session:
            client = InferenceClient(url, paths.admin_token.read_text().strip(), session=session,
                                     timeout_s=o.request_timeout_s)
            await ready_or_refused(client, proc, paths, step, cfg.inference.startup_timeout_s)
            out = await asyncio.wait_for(evaluator.run(client, step), timeout_s)
    except EvalError:
        raise
    except Exception:
        log_tail = (paths.logs_dir / "inference_0.log").read_text(errors="replace")[-2000:]
        log.error("inference server log (tail):\n%s", log_tail)
        raise
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(paths.root, ignore_errors=True)
        SCRATCH.remove(paths.root)
    return {"step_dir": str(step_dir), "step": step, **out}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="slurmrl-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("step_dir", type=Path, help="a published weights/step_N directory of a run")
    p.add_argument("--num-samples", type=int, default=None, help="eval records (default: orchestrator.eval_num_samples)")
    p.add_argument("--k", type=int, default=None, help="answers per record (default: orchestrator.eval_k; 1 = greedy)")
    p.add_argument("--out", type=Path, default=None, help="also write the metrics to this JSON file")
    args = p.parse_args(argv)
    for name in ("num_samples", "k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.out is not None and (problem := out_problem(args.out)):
        p.error(f"--out {args.out}: {problem}")  # before the server starts, not after the eval ran
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        out = asyncio.run(evaluate(args.step_dir, num_samples=args.num_samples, k=args.k))
    except Stopped as e:
        print(f"slurmrl-eval: stopped by signal {e.signum}", file=sys.stderr)
        return 128 + e.signum
    except EvalError as e:
        print(f"slurmrl-eval: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the server or a request failed: one line (the server log's tail is logged above)
        print(f"slurmrl-eval: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        while SCRATCH:  # normally removed by evaluate(); a signal between mkdtemp and its try lands here
            shutil.rmtree(SCRATCH.pop(), ignore_errors=True)
    text = json.dumps(out, indent=2, sort_keys=True)
    print(text)
    if args.out is not None:
        try:
            args.out.write_text(text + "\n")
        except OSError as e:
            print(f"slurmrl-eval: error: --out {args.out}: {e.strerror or e} (the metrics are above)", file=sys.stderr)
            return 1
    return 0


def out_problem(out: Path) -> str:
    """Why ``--out`` cannot be written ("" when it can): a directory, a missing or read-only parent."""
    if out.is_dir():
        return "is a directory (give a file name, e.g. DIR/eval.json)"
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return f"its directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        return "is not writable here"
    return ""


if __name__ == "__main__":
    sys.exit(main())
