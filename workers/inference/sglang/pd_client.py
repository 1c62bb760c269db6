"""Router Replay through prefill/decode disaggregation: the orchestrator pairs the servers itself.

Why not smg: in PD mode it answers with the decode server's response and merges only logprobs
from prefill (smg 1.13.0), while the prompt's routed experts exist only on the prefill server
(sglang 0.5.23 srt/disaggregation/prefill.py: once the KV transfer is done,
``_maybe_collect_routed_experts`` reads rows ``[start, prompt_len)``, the first sampled token
already appended). The decode server reports rows for every position, but for prompt positions
they are whatever its KV slots last held (it never ran those tokens). So with
``orchestrator.return_routed_experts`` and PD, each request goes to a prefill/decode pair
exactly as SGLang's own PD load balancer sends it, and the two answers are merged here:

  1. pick the pair: prefill by a hash of the group's routing key (every turn of an episode
     group lands where its prefix is cached), decode by a second hash of the key;
  2. one ``bootstrap_room`` (random 63-bit), ``bootstrap_host`` = the prefill server's host,
     ``bootstrap_port`` = its KV bootstrap port (ports.extra_ports); the same request to both
     at once (prefill: routing from position 0; decode: ``routed_experts_start_len`` =
     prompt length, so it sends only the rows it computed);
  3. merge per position: rows ``[0, P)`` from prefill, ``[P, P + C - 1)`` from decode; tokens,
     logprobs, versions and finish reason from decode.

Prefix-cache hits need nothing special: SGLang reads cached positions' routing from their KV
slots on the server that computed them, and each turn of a multi-turn episode is a new request
whose whole prompt (earlier completions included) is prefilled on the prefill server. When the
prefill rows are not exactly the prompt's (an abort, a cache tier that does not keep routing),
the result carries no routing: the sample is marked and ``trainer.replay_unreported`` decides
(recompute or mask), never a wrong row.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

import numpy as np

from workers.common.inference_client import GenerateResult, InferenceClient, InferenceError, decode_routed_experts
from workers.inference.sglang.ports import extra_ports

log = logging.getLogger("slurmrl.orchestrator")


def pick(key: str, n: int, salt: str) -> int:
    """A stable index in [0, n) from the routing key (the same on every orchestrator restart)."""
    return int.from_bytes(hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest(), "big") % n


def merge_routing(prefill_rows: Optional[np.ndarray], decode_rows: Optional[np.ndarray], prompt_len: int,
                  num_output: int) -> Optional[np.ndarray]:
    """Prompt rows from prefill then completion rows from decode, or None when either side did not
    report exactly its positions (the sample then goes to trainer.replay_unreported)."""
    if prefill_rows is None or decode_rows is None:
        return None
    if prefill_rows.shape[0] != prompt_len or decode_rows.shape[0] != max(num_output - 1, 0):
        return None
    return np.concatenate([prefill_rows, decode_rows.astype(prefill_rows.dtype)])


class PDPairClient:
    """Generation through one prefill/decode pair chosen per routing key (InferenceClient.generate's API)."""

    def __init__(self, prefill: Sequence[InferenceClient], decode: Sequence[InferenceClient],
                 bootstrap_ports: Sequence[int], *, key: str, shape: tuple[int, int, int]):
        i, j = pick(key, len(prefill), "prefill"), pick(key, len(decode), "decode")
        self.prefill, self.decode, self.routing_key = prefill[i], decode[j], key
        self.bootstrap = {"bootstrap_host": urlparse(self.prefill.base_url).hostname,
                          "bootstrap_port": bootstrap_ports[i]}
        self.base_url, self.timeout_s, self._shape = self.decode.base_url, self.decode.timeout_s, shape
        self.unreported = 0

    def __repr__(self) -> str:
        return f"PDPairClient({self.prefill.base_url} -> {self.decode.base_url}, key={self.routing_key})"

    async def generate(self, input_ids: list[int], *, temperature: float, max_new_tokens: int,
                       stop_token_ids: Sequence[int] = (), return_routed_experts: bool = False,
                       rid: Optional[str] = None, timeout_s: Optional[float] = None, **_: Any) -> GenerateResult:
        boot = {**self.bootstrap, "bootstrap_room": random.getrandbits(63)}
        body = {"input_ids": list(input_ids), "return_logprob": True, **boot,
                "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens,
                                    "stop_token_ids": list(stop_token_ids)}}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
        pre, dec = await asyncio.gather(
            self.prefill._call("POST", "/generate", body, timeout_s=timeout_s),
            self.decode.generate(input_ids, temperature=temperature, max_new_tokens=max_new_tokens,
                                 stop_token_ids=stop_token_ids, return_routed_experts=return_routed_experts,
                                 rid=rid, timeout_s=timeout_s, routed_experts_start_len=len(input_ids), extra=boot))
        if return_routed_experts and dec.finish_reason != "abort":
            dec.routed_experts = merge_routing(await self._prefill_rows(pre), dec.routed_experts, len(input_ids),
                                               len(dec.output_ids))
            if dec.routed_experts is None:
                self.unreported += 1
                log.warning("%s: routing of request %s not complete on both servers; the sample goes to "
                            "trainer.replay_unreported", self, rid)
        return dec

    async def _prefill_rows(self, answer: Any) -> Optional[np.ndarray]:
        try:
            b64 = answer["meta_info"].get("routed_experts")
        except (KeyError, TypeError, AttributeError):
            raise InferenceError(self.prefill.base_url + "/generate", 200, f"unexpected answer: {answer!r}"[:300]) \
                from None
        if b64 is None:
            return None
        try:
            return await asyncio.to_thread(decode_routed_experts, b64, *self._shape)
        except ValueError as e:
            raise InferenceError(self.prefill.base_url + "/generate", 200, str(e)) from None


class PDPairs:
    """``make_router``'s answer with PD and routed experts: a PDPairClient per prompt group."""

    def __init__(self, cfg: Any, topology: Any, admin_token: str, *, session: Any, timeout_s: float,
                 shape: tuple[int, int, int], health: Any):
        def client(url: str) -> InferenceClient:
            return InferenceClient(url, admin_token, session=session, timeout_s=timeout_s, num_layers=shape[0],
                                   top_k=shape[1], num_experts=shape[2])
        self.prefill = [client(u) for u in topology.prefill_urls]
        self.decode = [client(u) for u in topology.decode_urls]
        self.ports = [extra_ports(tuple(topology.inference_urls), u)[0] for u in topology.prefill_urls]
        self.prefix, self.shape, self.health = cfg.experiment, shape, health

    def for_key(self, key: str) -> PDPairClient:
        return PDPairClient(self.prefill, self.decode, self.ports, key=key, shape=self.shape)

    def for_group(self, group_id: int) -> PDPairClient:
        return self.for_key(f"{self.prefix}-g{group_id}")
