"""Env section: the task environment (``env/`` Hydra group)."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from omegaconf import MISSING


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    name: str = MISSING
    """Task name (``reverse_digits``)."""
    min_digits: int = 3
    """Shortest digit string of a prompt."""
    max_digits: int = 4
    """Longest digit string of a prompt."""
    num_symbols: int = 10
    """Distinct digit symbols (0..num_symbols-1)."""
    seed: int = 0
    """Seed of the prompt stream."""
    latency: str = "none"
    """Simulated env-step latency per episode (a sandbox/tool run): none | lognormal | pareto."""
    latency_median_s: float = 0.0
    """Median of the simulated latency in seconds."""
    latency_p99_over_median: float = 20.0
    """Tail heaviness: p99 / median of the simulated latency (>= 1)."""
    # ---- multi-turn agentic envs (code_repair, verifiers); reverse_digits ignores these ----
    max_turns: int = 4
    """Most model turns of one episode; the episode is then scored as it stands."""
    max_new_tokens_per_turn: int = 96
    """Generation budget of one model turn (stop token: end of turn)."""
    max_episode_tokens: int = 512
    """Prompt + every turn + every observation of an episode; must fit model.max_position_embeddings."""
    episode_timeout_s: float = 300.0
    """Wall-clock budget of one episode (generation + env steps); past it no new turn starts."""
    max_observation_bytes: int = 256
    """Tool output shown to the model is cut to this many bytes (long logs would eat the context)."""
    max_concurrent_env_steps: int = 2
    """Env steps (sandbox runs) running at once in this env; episodes beyond it wait, generation goes on."""
    num_functions: int = 1
    """code_repair: buggy functions per generated project (each with its own tests)."""
    num_tests_per_function: int = 3
    """code_repair: test functions per function; reward = fraction of all tests passing."""
    include_tool_help: bool = False
    """code_repair: describe the tool-call format in the first prompt (for models that can read it;
    the tiny model cannot, and the help would cost ~400 tokens of its context)."""
    sandbox_mode: str = "auto"
    """auto | namespaces (root) | userns (unprivileged) | rlimits (weak fallback); see envs/sandbox.py."""
    sandbox_python: str = "/usr/bin/python3"
    """Interpreter that runs the tests inside the sandbox (its prefix is bind-mounted read-only)."""
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
    verifiers_env: str = ""
    """env=verifiers: module name of an environment written for the ``verifiers`` package."""
    # ---- reverse_text (a pretrained model's tokenizer and chat template) ----
    min_words: int = 3
    """reverse_text: fewest words of a prompt's text."""
    max_words: int = 5
    """reverse_text: most words of a prompt's text."""
    max_new_tokens: int = 24
    """reverse_text: generation budget of the answer (stop token: the chat template's end of turn)."""
    system_prompt: str = ""
    """reverse_text: system message of the chat ("" keeps the model template's default)."""
    num_examples: int = 2
    """reverse_text: worked examples, given as earlier user/assistant turns (0..2)."""
