"""code_repair: fix a tiny buggy Python project with tools; reward = fraction of tests passing.

Episode: the first prompt names the module and its test file; each model turn makes one
tool call (format: envs/tools.py) and gets its output back as the next observation:

  read_file path=P      file content (cut to env.max_observation_bytes)
  write_file path=P     replace P with the body (test files and paths outside the
                        project are refused)
  patch path=P          SEARCH/REPLACE edit, the SEARCH text must occur exactly once
  run_tests             run the test file in the sandbox: "passed k/n" + the failures
  submit                end the episode; its reward is the final test score

A turn without a valid call costs the turn and shows an error (never a crash). When a
limit ends the episode first, the runner asks ``final_reward``: the project is scored as
it stands. File tools run here, as the orchestrator's user, so every path is checked to
stay inside the episode's scratch directory (no absolute paths, no ``..``, no symlinks);
only test execution runs untrusted code, and it runs in the sandbox (envs/sandbox.py).
Scores are cached by project content, so unchanged projects cost no sandbox run.

This module is the env's whole home: its config (the schema of ``env=code_repair``), its plan
check, its vocabulary (the byte chat template, envs/chat.py) and the env; the spec is at the bottom.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import secrets
import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from workers.common.config.ranges import NONEMPTY, TEXT, gt, limits, one_of, positive
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import GeneratedEvalSplit, MultiTurnEnv, MultiTurnEnvConfig, StepResult, Stopwatch, check_multi_turn
from workers.orchestrator.envs.chat import VOCAB_SIZE, ChatTemplate
from workers.orchestrator.envs.code_tasks import Task, make_task
from workers.orchestrator.envs.sandbox import Sandbox, SandboxLimits, SandboxSetupError, prove_python
from workers.orchestrator.envs.spec import EnvSpec
from workers.orchestrator.envs.tools import ToolCall, ToolCallError, ToolSpec, parse_patch, parse_tool_call, usage

TOOLS = {t.name: t for t in (
    ToolSpec("read_file", ("path",), doc="show a file"),
    ToolSpec("write_file", ("path",), body=True, doc="replace a file with the body"),
    ToolSpec("patch", ("path",), body=True, doc="SEARCH/REPLACE edit of a file"),
    ToolSpec("run_tests", doc="run the tests"),
    ToolSpec("submit", doc="end the episode"),
)}
SAFE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$")
MAX_FILES, MAX_FILE_BYTES, SCORE_CACHE = 32, 16384, 4096
SANDBOX_MODES = ("auto", "namespaces", "userns", "rlimits")


@dataclass(kw_only=True)
class CodeRepairConfig(MultiTurnEnvConfig):
    name: str = "code_repair"
    """Task name."""
    max_observation_bytes: int = 256
    """Tool output shown to the model is cut to this many bytes (long logs would eat the context)."""
    num_functions: int = 1
    """Buggy functions per generated project (each with its own tests)."""
    num_tests_per_function: int = 3
    """Test functions per function; reward = fraction of all tests passing."""
    include_tool_help: bool = False
    """Describe the tool-call format in the first prompt (for models that can read it; the tiny
    model cannot, and the help would cost ~400 tokens of its context)."""
    sandbox_mode: str = "auto"
    """auto | namespaces (root) | userns (unprivileged) | rlimits (the weak mode); see envs/sandbox.py.
    auto never degrades silently: where neither namespace mode works it refuses to run untrusted
    code at env start unless ``sandbox_allow_weak`` is true."""
    sandbox_allow_weak: bool = False
    """Accept the weak rlimits mode (no namespaces: code under test runs as the job user, kept away
    from the run by a private copy as cwd/HOME, closed fds, a clean environment, a reaper, and
    Landlock where the kernel has it). Needed for sandbox_mode=rlimits, and for auto on hosts
    without root or user namespaces."""
    sandbox_python: str = "/usr/bin/python3"
    """Python 3 interpreter that runs the tests inside the sandbox (its prefix is bind-mounted read-only);
    proven at plan time (and when the env starts) by running it to print its version."""
    sandbox_scratch_root: Optional[str] = None
    """Node-local directory for per-episode scratch projects; None: $TMPDIR/slurmrl-sandbox."""
    sandbox_cpu_s: int = 2
    """CPU seconds of one test run (RLIMIT_CPU)."""
    sandbox_memory_mb: int = 256
    """Address space of each sandboxed process in MiB (RLIMIT_AS)."""
    sandbox_file_size_kb: int = 1024
    """Largest file a sandboxed process may write, KiB (RLIMIT_FSIZE)."""
    sandbox_num_procs: int = 16
    """Processes of the sandbox's uid (RLIMIT_NPROC): a fork bomb stops here."""
    sandbox_timeout_s: float = 10.0
    """Wall-clock deadline of one test run; past it every process of the run is killed."""
    sandbox_tmp_mb: int = 16
    """Size of the sandbox's private /tmp (tmpfs)."""


def check_sandbox(run_cfg: Any) -> None:
    e = run_cfg.env
    for key in ("sandbox_cpu_s", "sandbox_memory_mb", "sandbox_file_size_kb", "sandbox_num_procs", "sandbox_tmp_mb"):
        positive(f"env.{key}", getattr(e, key))
    positive("env.sandbox_timeout_s", e.sandbox_timeout_s)
    if e.sandbox_mode not in SANDBOX_MODES:
        raise ValueError(f"env.sandbox_mode={e.sandbox_mode!r}; choose one of {list(SANDBOX_MODES)}")
    if e.sandbox_mode == "rlimits" and not e.sandbox_allow_weak:
        raise ValueError("env.sandbox_mode=rlimits is the weak sandbox (untrusted code runs without namespaces, as "
                         "the job user when not root); set env.sandbox_allow_weak=true to accept it, or use "
                         "env.sandbox_mode=auto")


def check(run_cfg: Any) -> None:
    """Episode limits, project size and sandbox limits."""
    e = run_cfg.env
    for key in ("max_observation_bytes", "num_functions", "num_tests_per_function"):
        positive(f"env.{key}", getattr(e, key))
    check_multi_turn(run_cfg)
    check_sandbox(run_cfg)


class CodeRepairEnv(GeneratedEvalSplit, MultiTurnEnv):
    name = "code_repair"

    def __init__(self, cfg: CodeRepairConfig, *, seed: int):
        super().__init__(cfg, seed=seed)
        if cfg.num_functions < 1 or cfg.num_tests_per_function < 1:
            raise ValueError(f"env.num_functions({cfg.num_functions}) and env.num_tests_per_function"
                             f"({cfg.num_tests_per_function}) must be >= 1")
        self.template = ChatTemplate()
        self.stop_token_ids = self.template.stop_token_ids
        self.vocab_size = VOCAB_SIZE
        self.rng = random.Random(seed * 1_000_003 + cfg.seed)
        self.next_id = 0
        self.sandbox = make_sandbox(cfg)  # auto: probes now, refuses the weak mode unless allowed
        self.scratch = Path(tempfile.mkdtemp(prefix=f"episodes-{os.getpid()}-", dir=self.sandbox.scratch_root))
        weakref.finalize(self, shutil.rmtree, self.scratch, ignore_errors=True)  # sessions remove their own dirs
        self.scores: OrderedDict[str, tuple[int, str, bool]] = OrderedDict()  # content hash -> result

    def sample_task(self) -> Task:
        self.next_id += 1
        return make_task(self.next_id, self.rng, num_functions=self.cfg.num_functions,
                         num_tests=self.cfg.num_tests_per_function)

    def session(self, task: Task, episode_id: str) -> "CodeRepairSession":
        return CodeRepairSession(self, task, episode_id)

    def first_message(self, task: Task) -> str:
        text = f"Fix {task.module_file} so that the tests in {task.test_file} pass.\nfiles: {' '.join(task.files)}\n"
        if self.cfg.include_tool_help:
            text += "One tool call per turn: " + usage(TOOLS) + "\n"
        return text

    def state(self) -> dict:
        return {"next_id": self.next_id, "rng": repr(self.rng.getstate())}


class CodeRepairSession:
    """One episode: a scratch copy of the project, edited by tools, tested in the sandbox."""

    def __init__(self, env: CodeRepairEnv, task: Task, episode_id: str):
        self.env, self.task, self.episode_id = env, task, episode_id
        self.dir: Optional[Path] = None
        self.metrics = {"sandbox_runs": 0, "sandbox_timeouts": 0, "tool_errors": 0, "env_s": 0.0}

    async def reset(self) -> list[int]:
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.episode_id}-", dir=self.env.scratch))
        self.dir.chmod(0o755)  # the sandbox uid reads it (read-only bind at /work)
        for name, text in self.task.files.items():
            self._write(name, text)
        return self.env.template.prompt_ids([{"role": "user", "content": self.env.first_message(self.task)}])

    async def step(self, turn_ids: list[int]) -> StepResult:
        watch = Stopwatch()
        with watch:
            call = parse_tool_call(self.env.template.turn_text(turn_ids), TOOLS, max_body_chars=MAX_FILE_BYTES)
            info: dict = {"tool": call.name if isinstance(call, ToolCall) else "none"}
            reward, done = 0.0, False
            if call is None:
                text = "error: no tool call; tools: " + usage(TOOLS)
            elif isinstance(call, ToolCallError):
                text = "error: " + call.message
            elif call.name == "submit":
                reward, done, text = await self.final_reward(), True, ""
            elif call.name == "run_tests":
                passed, text, _ = await self.score()
            else:
                text = self._file_tool(call)
            if text.startswith("error:"):
                info["tool_error"] = 1
                self.metrics["tool_errors"] += 1
            obs = text.encode()[: self.env.cfg.max_observation_bytes].decode("utf-8", "ignore")
        self.metrics["env_s"] += watch.total
        info["env_s"] = watch.total
        ids = [] if done else self.env.template.observation_ids(turn_ids, obs)
        return StepResult(observation_ids=ids, reward=reward, done=done, info=info)

    async def final_reward(self) -> float:
        passed, _, _ = await self.score()
        return passed / len(self.task.test_names)

    async def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def score(self) -> tuple[int, str, bool]:
        """(tests passed, summary text, timed out) of the project as it stands (cached by content)."""
        key = self._content_hash()
        cache = self.env.scores
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        results, timed_out = await self.run_test_file(self.task.test_file)
        passed = sum(1 for n in self.task.test_names if results.get(n, ("",))[0] == "PASS")
        lines = [f"passed {passed}/{len(self.task.test_names)}" + (" (killed: time limit)" if timed_out else "")]
        lines += [f"{results[n][0]} {n} {results[n][1]}".rstrip() for n in self.task.test_names
                  if n in results and results[n][0] != "PASS"]
        if "<import>" in results:
            lines.append(f"ERROR import: {results['<import>'][1]}")
        out = (passed, "\n".join(lines), timed_out)
        cache[key] = out
        if len(cache) > SCORE_CACHE:
            cache.popitem(last=False)
        return out

    async def run_test_file(self, test_file: str) -> tuple[dict[str, tuple[str, str]], bool]:
        """Run ``test_file`` of the project in the sandbox: ({test name: (PASS|FAIL|ERROR, message)}, timed out).
        Only lines carrying this run's nonce count (sandbox_runner.py)."""
        nonce = secrets.token_hex(8)
        async with self.env.step_slots:
            res = await self.env.sandbox.run_python([self.env.sandbox.runner, test_file], project=self.dir,
                                                    stdin=(nonce + "\n").encode())
        self.metrics["sandbox_runs"] += 1
        self.metrics["sandbox_mode"] = res.mode  # namespaces | userns | rlimits (the weak fallback)
        timed_out = res.timed_out or res.signal is not None
        self.metrics["sandbox_timeouts"] += int(timed_out)
        results = {}
        for line in res.stdout.splitlines():
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[0] == nonce:
                results[parts[2].split("::")[-1]] = (parts[1], parts[3] if len(parts) > 3 else "")
        return results, timed_out

    def _file_tool(self, call: ToolCall) -> str:
        path = self._resolve(call.args["path"])
        if isinstance(path, str):
            return path
        rel = call.args["path"]
        if call.name == "read_file":
            if not path.is_file():
                return f"error: no file {rel}; files: {' '.join(self._files())}"
            return path.read_text(errors="replace")
        if os.path.basename(rel).startswith("test_"):
            return f"error: {rel} is a test file; tests are read-only"
        if call.name == "write_file":
            if not path.exists() and len(self._files()) >= MAX_FILES:
                return f"error: at most {MAX_FILES} files per project"
            self._write(rel, call.body)
            return f"wrote {rel} ({len(call.body)} chars)"
        parsed = parse_patch(call.body)
        if isinstance(parsed, ToolCallError):
            return "error: " + parsed.message
        if not path.is_file():
            return f"error: no file {rel}"
        old, new = parsed
        text = path.read_text(errors="replace")
        if text.count(old) != 1:
            return f"error: SEARCH text occurs {text.count(old)} times in {rel}; it must occur exactly once"
        self._write(rel, text.replace(old, new, 1))
        return f"patched {rel}"

    def _resolve(self, rel: str):
        """Project path for ``rel`` or an error string: relative, no '..', no symlink, inside the project."""
        if not SAFE_PATH.match(rel) or ".." in rel.split("/") or len(rel) > 128:
            return f"error: bad path {rel[:64]!r}: use a relative path inside the project, e.g. {self.task.module_file}"
        path = self.dir / rel
        here = self.dir.resolve()
        for p in [path, *path.parents]:
            if p == self.dir:
                break
            if p.is_symlink():
                return f"error: {rel} is a symlink"
        if here not in path.resolve().parents:
            return f"error: {rel} is outside the project"
        return path

    def _write(self, rel: str, text: str) -> None:
        path = self.dir / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)

    def _files(self) -> list[str]:
        return sorted(str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if p.is_file())

    def _content_hash(self) -> str:
        h = hashlib.sha256()
        for rel in self._files():
            h.update(rel.encode() + b"\0" + (self.dir / rel).read_bytes() + b"\0")
        return h.hexdigest()


def make_sandbox(cfg: CodeRepairConfig) -> Sandbox:
    return Sandbox(SandboxLimits(cpu_s=cfg.sandbox_cpu_s, memory_mb=cfg.sandbox_memory_mb,
                                 file_size_kb=cfg.sandbox_file_size_kb, num_procs=cfg.sandbox_num_procs,
                                 timeout_s=cfg.sandbox_timeout_s, tmp_mb=cfg.sandbox_tmp_mb),
                   mode=cfg.sandbox_mode, python=cfg.sandbox_python, scratch_root=cfg.sandbox_scratch_root,
                   allow_weak=cfg.sandbox_allow_weak)


def host_check(run_cfg) -> None:
    """On the launcher's machine (local runs): ``auto`` finds an isolating sandbox mode here, or the
    weak mode is allowed; the same refusal the env would raise when it starts, but before anything runs."""
    python = run_cfg.env.sandbox_python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"env.sandbox_python={python!r} is not an executable file here "
                         f"({'missing' if not os.path.exists(python) else 'a directory' if os.path.isdir(python) else 'not executable'}); "
                         f"set it to the interpreter that runs the tests in the sandbox")
    try:
        prove_python(python)
    except SandboxSetupError as e:
        raise ValueError(f"env.sandbox_python: {e}; set it to a Python 3 interpreter (the tests run with it)") from None
    try:
        make_sandbox(run_cfg.env)
    except SandboxSetupError as e:
        raise ValueError(f"env.sandbox_mode={run_cfg.env.sandbox_mode}: {e}") from None


limits(CodeRepairConfig, max_observation_bytes=gt(0), num_functions=gt(0), num_tests_per_function=gt(0),
       sandbox_mode=one_of(*SANDBOX_MODES), sandbox_python=NONEMPTY, sandbox_scratch_root=TEXT, sandbox_cpu_s=gt(0),
       sandbox_memory_mb=gt(0), sandbox_file_size_kb=gt(0), sandbox_num_procs=gt(0), sandbox_timeout_s=gt(0),
       sandbox_tmp_mb=gt(0))
ENVS.register(EnvSpec(name="code_repair", config=CodeRepairConfig, vocab_size=lambda cfg: VOCAB_SIZE, env_check=check,
                      host_check=host_check, eval_split=True,
                      make=lambda cfg, *, seed, model=None: CodeRepairEnv(cfg, seed=seed),
                      summary="fix a tiny buggy Python project with tools; tests run in a sandbox"))
