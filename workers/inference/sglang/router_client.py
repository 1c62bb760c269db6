"""Generation through the router (smg), with a routing key per prompt group.

Why: with SGLang the orchestrator sends ``/generate`` to the router, which picks the server
(and, with prefill/decode disaggregation, one prefill + one decode server and the KV
bootstrap between them). Admin calls never go through it: pause, weight updates and
readiness go to every server directly, so each server's answer is seen and a server that
fails is named (workers/orchestrator/loop.py). The orchestrator gets a :class:`Router` from this
backend's spec (``make_router``), never by importing this module.

Sticky routing: every request of a prompt group carries the same routing key in the header
smg reads (``inference.sglang.router.routing_key_header``, default ``x-smg-routing-key``);
with the ``consistent_hashing`` policy one key always maps to one server. A group's samples
share the prompt, and a multi-turn episode re-sends its whole history each turn, so keying
by group puts the prompt in one server's radix cache once and keeps every later turn a
prefix hit there. The key is the experiment and the group id: stable across a requeue.

Wire format is unchanged: a :class:`RoutedClient` is an InferenceClient whose requests add
one header, so the same response parsing and checks apply.
"""
from __future__ import annotations

from typing import Optional

import aiohttp

from workers.common.inference_client import InferenceClient


class RoutedClient(InferenceClient):
    """An InferenceClient that adds ``{header: key}`` to every request (the router's routing key)."""

    def __init__(self, base_url: str, admin_token: str, *, header: str, key: str, session: aiohttp.ClientSession,
                 timeout_s: float, num_layers: Optional[int] = None, top_k: Optional[int] = None,
                 num_experts: Optional[int] = None):
        super().__init__(base_url, admin_token, session=session, timeout_s=timeout_s, num_layers=num_layers,
                         top_k=top_k, num_experts=num_experts)
        self._auth = {**self._auth, header: key}
        self.routing_key = key

    def __repr__(self) -> str:
        return f"RoutedClient({self.base_url}, key={self.routing_key})"


class Router:
    """Factory of per-group clients for one router URL (they share the session and the shape)."""

    def __init__(self, url: str, admin_token: str, *, header: str, prefix: str, session: aiohttp.ClientSession,
                 timeout_s: float, shape: tuple[Optional[int], Optional[int], Optional[int]] = (None, None, None)):
        self.url, self.header, self.prefix = url, header, prefix
        self._token, self._session, self._timeout_s, self._shape = admin_token, session, timeout_s, shape
        self.health = self.for_key(f"{prefix}-health")
        """A client for the router's own /health_generate (readiness)."""

    def key(self, group_id: int) -> str:
        return f"{self.prefix}-g{group_id}"

    def for_key(self, key: str) -> RoutedClient:
        num_layers, top_k, num_experts = self._shape
        return RoutedClient(self.url, self._token, header=self.header, key=key, session=self._session,
                            timeout_s=self._timeout_s, num_layers=num_layers, top_k=top_k, num_experts=num_experts)

    def for_group(self, group_id: int) -> RoutedClient:
        return self.for_key(self.key(group_id))
