"""env=verifiers: environments written for the ``verifiers`` package (PyPI) — NOT IMPLEMENTED.

Checked against verifiers 0.4.0 (2026-10; its wheel was read, not installed into the shared
venv). Why there is no adapter yet:

* Dependencies: ``pip install verifiers`` adds ~60 packages to this venv, among them
  transformers 5.24 + tokenizers + huggingface_hub, openai, anthropic, mcp 2.0,
  prime-sandboxes, prime-tunnel, renderers[multimodal], pydantic, pyzmq, uvicorn and
  cryptography. That is too heavy for the orchestrator's CPU node image and the CI venv.
  Re-checked 2026-12-03 (``pip download verifiers --no-deps``, its METADATA): 0.4.0 is still the
  newest; 25 direct requirements (aiohttp>=3.14.1, anthropic, gepa, httpx2, math-verify, mcp==2.0.0,
  openai>=2.54, prime-pydantic-config, prime-runs, prime-sandboxes, prime-tunnel, pyzmq,
  renderers[multimodal] -> transformers, pillow, tiktoken, openai-harmony, uvicorn, ...). None of
  them requires torch, so it would not pull a CUDA torch; it is the adapter below that is missing.
* Control flow: a verifiers v1 ``Env`` owns the rollout loop (taskset -> agent ->
  harness -> runtime) and reaches the model through its own HTTP client: an
  OpenAI-compatible endpoint, or its ``TrainClient`` that renders chats to token ids with
  an HF-tokenizer ``renderers.Renderer`` and calls a vLLM-style generate endpoint. Our
  episode runner (episodes.py) is the loop instead, and talks SGLang's /generate.
* Tokens: our trainer needs each turn's sampled ids, logprobs, weight versions and routed
  experts, with observations appended as exact token ids (episodes.py's prefix rule).
  verifiers returns its own ``TurnTokens``/``SamplingMask`` per turn from its client.

What an adapter would take (no network is needed for local runtimes, so it is feasible):
  1. a ``verifiers.v1.clients.client.Client`` subclass whose generate call forwards the
     rendered ids to our InferenceClient and records GenerateResult per turn;
  2. a ``renderers.Renderer`` for envs/chat.py's byte template (or an HF tokenizer for
     a real model), so that verifiers' renders are the token ids we train on;
  3. a MultiTurnEnv here whose session runs one verifiers episode with that client and
     maps its turns to one Sample (model tokens loss 1, everything else 0), reward from
     its rubric; prefix consistency must then be asserted turn by turn, since verifiers
     re-renders the whole chat each turn.
Selecting ``env=verifiers`` is therefore refused by the plan (``check``) with this explanation,
before anything starts; the config schema exists so that configs can be written and checked.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from workers.common.config.ranges import TEXT, limits
from workers.common.registry import ENVS
from workers.orchestrator.envs.base import MultiTurnEnv, MultiTurnEnvConfig
from workers.orchestrator.envs.chat import VOCAB_SIZE
from workers.orchestrator.envs.spec import EnvSpec

WHY = ("env=verifiers is not implemented: verifiers 0.4.0 pulls ~60 packages (transformers, openai, "
       "anthropic, mcp, prime-sandboxes, ...) and owns the rollout loop through its own OpenAI/vLLM client; "
       "missing here: a verifiers Client that forwards to our inference client, a Renderer for our chat "
       "template, and a session mapping its turns to token ids (workers/orchestrator/envs/verifiers_adapter.py). "
       "Use env=code_repair, or an env class of your own: env=target env._target_=my_pkg.envs:MyEnv.")


@dataclasses.dataclass(kw_only=True)
class VerifiersConfig(MultiTurnEnvConfig):
    name: str = "verifiers"
    """Task name."""
    verifiers_env: str = ""
    """Module name of an environment written for the ``verifiers`` package."""


limits(VerifiersConfig, verifiers_env=TEXT)


def check(run_cfg: Any) -> None:
    """Refuses every config: there is no adapter yet (module docstring)."""
    raise ValueError(f"{WHY} (env.verifiers_env={run_cfg.env.verifiers_env!r})")


class VerifiersEnv(MultiTurnEnv):
    """Placeholder that refuses to start (the plan refuses it first)."""

    name = "verifiers"

    def __init__(self, cfg: VerifiersConfig, *, seed: int):
        raise NotImplementedError(f"{WHY} (env.verifiers_env={cfg.verifiers_env!r})")


# check= (not env_check=): the refusal comes first, not after a vocabulary complaint.
ENVS.register(EnvSpec(name="verifiers", config=VerifiersConfig, vocab_size=lambda cfg: VOCAB_SIZE, check=check,
                      make=lambda cfg, *, seed, model=None: VerifiersEnv(cfg, seed=seed),
                      summary="environments of the verifiers package (not implemented: refused by the plan)"))
