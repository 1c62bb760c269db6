"""env=verifiers: environments written for the ``verifiers`` package (PyPI) — NOT IMPLEMENTED.

Checked against verifiers 0.4.0 (2026-10; its wheel was read, not installed into the shared
venv). Why there is no adapter yet:

* Dependencies: ``pip install verifiers`` adds ~60 packages to this venv, among them
  transformers 5.24 + tokenizers + huggingface_hub, openai, anthropic, mcp 2.0,
  prime-sandboxes, prime-tunnel, renderers[multimodal], pydantic, pyzmq, uvicorn and
  cryptography. That is too heavy for the orchestrator's CPU node image and the CI venv.
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
Selecting ``env.name=verifiers`` therefore fails at startup with this explanation.
"""
from __future__ import annotations

from workers.common.config import EnvConfig

WHY = ("env.name=verifiers is not implemented: verifiers 0.4.0 pulls ~60 packages (transformers, openai, "
       "anthropic, mcp, prime-sandboxes, ...) and owns the rollout loop through its own OpenAI/vLLM client; "
       "see workers/orchestrator/envs/verifiers_adapter.py for what an adapter needs. Use env=code_repair.")


class VerifiersEnv:
    """Placeholder that refuses to start (the plan accepts the name so configs can be written)."""

    is_multi_turn = True
    name = "verifiers"

    def __init__(self, cfg: EnvConfig, *, seed: int):
        raise NotImplementedError(f"{WHY} (env.verifiers_env={cfg.verifiers_env!r})")
