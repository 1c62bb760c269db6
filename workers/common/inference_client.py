"""Async client for inference workers: SGLang servers and the embedded engine alike.

Why one client: both speak SGLang's native HTTP API (routes and field names of SGLang
0.5.x), so the orchestrator never knows which backend it drives. No torch import here.

Rules it keeps: every call has a deadline (aiohttp ClientTimeout); a 429 (the server's
admission queue is full) is retried after Retry-After, backing off, within that deadline;
any other failure (non-2xx,
refused connection, timeout, unparsable body) raises :class:`InferenceError` with the
URL, the HTTP status (None when there was no answer) and the remote response text.
Routed experts arrive as base64 of int32 [positions, layers, top_k]; they are decoded in
a worker thread (``asyncio.to_thread``) so the event loop never decodes, and kept as a
compact uint8/uint16 array from there on.

Weight update protocol, driven by the orchestrator per worker (docs/design.md, "Roles and data flow"):
  pause_generation("in_place") -> update_weights_from_disk(step_dir, v) -> continue_generation().
In-flight requests survive; their tokens report the version that produced each of them.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np

from workers.common.protocol import PeerTimeout


BUSY_BACKOFF_S = 0.05
"""First wait after a 429 (doubled each retry, up to BUSY_BACKOFF_MAX_S; at least Retry-After)."""
BUSY_BACKOFF_MAX_S = 2.0


def _seconds(retry_after: str) -> float:
    """Retry-After in seconds (the HTTP-date form is not used by our servers: 0)."""
    try:
        return max(0.0, min(float(retry_after), BUSY_BACKOFF_MAX_S))
    except ValueError:
        return 0.0


class InferenceError(RuntimeError):
    """A call to an inference worker failed; carries url, status and the remote text."""

    def __init__(self, url: str, status: Optional[int], text: str):
        self.url, self.status, self.text = url, status, text
        super().__init__(f"{url} -> {status if status is not None else 'no answer'}: {text[:2000]}")


@dataclasses.dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float]
    """Logprob of each output token under the sampling distribution."""
    token_versions: list[int]
    """Weight version per output token (SGLang sends only one: then it is repeated)."""
    weight_version: int
    """Version the server reported at the end of the request (-1 if it is not an integer)."""
    finish_reason: str
    """``stop`` | ``length`` | ``abort``."""
    routed_experts: Optional[np.ndarray] = None
    """uint8 (num_experts <= 256) or uint16 [prompt+completion-1-start, L, k]: row i holds
    the experts used when position start+i was the input token."""
    finish_detail: dict = dataclasses.field(default_factory=dict)
    """The raw finish_reason object (``matched`` stop id, ``length``, abort ``message``)."""
    rid: Optional[str] = None
    prompt_tokens: int = 0


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):  # SGLang's default version is the string "default"
        return -1


def decode_routed_experts(b64: str, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """SGLang's base64 int32 routing -> [n, L, k] uint8/uint16 (blocking: call off the loop)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts has {flat.size} ids, not a multiple of layers*top_k="
                         f"{num_layers}*{top_k}")
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"routed_experts ids span [{flat.min()}, {flat.max()}], outside [0, {num_experts})")
    return flat.astype(np.uint8 if num_experts <= 256 else np.uint16).reshape(-1, num_layers, top_k)


class InferenceClient:
    """One worker. ``num_layers/top_k/num_experts`` are needed to decode routed experts;
    left None they are read once from /get_model_info (the embedded engine reports them,
    SGLang does not: pass them from cfg.model for SGLang workers)."""

    def __init__(self, base_url: str, admin_token: str, *, session: aiohttp.ClientSession, timeout_s: float,
                 num_layers: Optional[int] = None, top_k: Optional[int] = None, num_experts: Optional[int] = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = session
        self._auth = {"Authorization": f"Bearer {admin_token}"}
        self._shape = (num_layers, top_k, num_experts) if None not in (num_layers, top_k, num_experts) else None
        self._shape_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"InferenceClient({self.base_url})"

    async def _call(self, method: str, path: str, body: Optional[dict] = None, *,
                    timeout_s: Optional[float] = None) -> Any:
        url = self.base_url + path
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + timeout
        delay = BUSY_BACKOFF_S
        while True:
            left = deadline - time.monotonic()
            try:
                async with self._session.request(method, url, json=body, headers=self._auth,
                                                 timeout=aiohttp.ClientTimeout(total=max(left, 0.01))) as resp:
                    text = await resp.text()
                    status = resp.status
                    retry_after = resp.headers.get("Retry-After", "")
            except asyncio.TimeoutError:
                raise InferenceError(url, None, f"no answer within {timeout:.1f}s") from None
            except aiohttp.ClientError as e:
                raise InferenceError(url, None, f"{type(e).__name__}: {e}") from None
            if status != 429:
                break
            # Busy (the server's admission queue is full): back off and retry within the deadline.
            wait = max(delay, _seconds(retry_after))
            if time.monotonic() + wait >= deadline:
                raise InferenceError(url, status, f"still busy (429) at the {timeout:.1f}s deadline: {text}")
            await asyncio.sleep(wait)
            delay = min(delay * 2, BUSY_BACKOFF_MAX_S)
        if not 200 <= status < 300:
            raise InferenceError(url, status, text)
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text  # SGLang answers some admin routes in plain text

    async def generate(self, input_ids: list[int], *, temperature: float, max_new_tokens: int,
                       stop_token_ids: Sequence[int] = (), return_routed_experts: bool = False,
                       rid: Optional[str] = None, timeout_s: Optional[float] = None,
                       routed_experts_start_len: int = 0, extra: Optional[dict] = None) -> GenerateResult:
        """One request. ``routed_experts_start_len``: routing only from that position on (SGLang's
        field); ``extra``: more GenerateReqInput fields (PD bootstrap host/port/room)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens,
                                "stop_token_ids": list(stop_token_ids)},
            "return_logprob": True,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = routed_experts_start_len
        body.update(extra or {})
        if rid is not None:
            body["rid"] = rid
        out = await self._call("POST", "/generate", body, timeout_s=timeout_s)
        url = self.base_url + "/generate"
        try:
            meta = out["meta_info"]
            ids = [int(t) for t in out["output_ids"]]
            logprobs = [float(x[0]) for x in meta["output_token_logprobs"]]
            version = _version(meta.get("weight_version"))
            versions = meta.get("output_token_weight_versions") or [version] * len(ids)
            finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
            finish = {"type": finish} if isinstance(finish, str) else dict(finish)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InferenceError(url, 200, f"unexpected /generate response ({type(e).__name__}: {e}): "
                                           f"{json.dumps(out)[:500]}") from None
        if len(logprobs) != len(ids) or len(versions) != len(ids):
            raise InferenceError(url, 200, f"{len(ids)} output ids but {len(logprobs)} logprobs and "
                                           f"{len(versions)} versions")
        result = GenerateResult(output_ids=ids, output_logprobs=logprobs, token_versions=[int(v) for v in versions],
                                weight_version=version, finish_reason=str(finish.get("type")), finish_detail=finish,
                                rid=meta.get("id"), prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))))
        if return_routed_experts:
            result.routed_experts = await self._routed(meta, result, len(input_ids), url, routed_experts_start_len)
        return result

    async def _routed(self, meta: dict, result: GenerateResult, prompt_len: int, url: str,
                      start: int = 0) -> Optional[np.ndarray]:
        b64 = meta.get("routed_experts")
        if b64 is None:
            if result.finish_reason == "abort":
                return None  # aborted before its prompt was ever run
            raise InferenceError(url, 200, "routed_experts missing from meta_info; SGLang needs "
                                           "--enable-return-routed-experts")
        num_layers, top_k, num_experts = await self._routing_shape()
        try:
            arr = await asyncio.to_thread(decode_routed_experts, b64, num_layers, top_k, num_experts)
        except ValueError as e:
            raise InferenceError(url, 200, str(e)) from None
        expected = prompt_len + len(result.output_ids) - 1 - start
        if result.finish_reason != "abort" and arr.shape[0] != expected:
            raise InferenceError(url, 200, f"routed_experts covers {arr.shape[0]} positions, expected "
                                           f"prompt+completion-1-start = {expected}")
        return arr

    async def _routing_shape(self) -> tuple[int, int, int]:
        async with self._shape_lock:
            if self._shape is None:
                info = await self.get_model_info()
                try:
                    self._shape = (int(info["num_layers"]), int(info["top_k"]), int(info["num_experts"]))
                except (KeyError, TypeError, ValueError):
                    raise InferenceError(self.base_url + "/get_model_info", 200,
                                         "no num_layers/top_k/num_experts: pass them to InferenceClient(...)") from None
            return self._shape

    async def health(self) -> bool:
        """True when the server answers /health with 2xx (never raises)."""
        try:
            await self._call("GET", "/health")
            return True
        except InferenceError:
            return False

    async def health_generate(self, timeout_s: Optional[float] = None) -> None:
        """Runs a 1-token generation on the server; raises InferenceError if it fails."""
        await self._call("GET", "/health_generate", timeout_s=timeout_s)

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info")

    async def server_info(self) -> dict:
        return await self._call("GET", "/server_info")

    async def pause_generation(self, mode: str = "in_place") -> dict:
        """Stop decoding between steps; ``in_place`` keeps requests and KV cache."""
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int, *, abort_all_requests: bool = False,
                                       timeout_s: Optional[float] = None, allow_rollback: bool = False) -> dict:
        """Load a published ``weights/step_N`` dir as version ``weight_version``.

        Raises InferenceError when the server refuses it (it then keeps its old weights); the
        embedded engine refuses a version older than its own with 409 unless ``allow_rollback``
        (our extension field, sent only when set: SGLang refuses unknown fields).
        """
        body = {"model_path": model_path, "load_format": None, "abort_all_requests": abort_all_requests,
                "weight_version": str(weight_version), "flush_cache": False}
        if allow_rollback:
            body["allow_rollback"] = True
        out = await self._call("POST", "/update_weights_from_disk", body, timeout_s=timeout_s)
        if not isinstance(out, dict) or not out.get("success"):
            raise InferenceError(self.base_url + "/update_weights_from_disk", 200, json.dumps(out))
        return out

    async def _admin(self, path: str, body: dict, timeout_s: Optional[float]) -> dict:
        out = await self._call("POST", path, body, timeout_s=timeout_s)
        if not isinstance(out, dict) or not out.get("success"):
            raise InferenceError(self.base_url + path, 200, json.dumps(out))
        return out

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: Optional[float] = None) -> dict:
        """Join the weight-update group (blocks until every member joined; SGLang's fields)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._admin("/init_weights_update_group", body, timeout_s)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], group_name: str,
                                              weight_version: Optional[int], load_format: Optional[str] = None,
                                              flush_cache: bool = False, abort_all_requests: bool = False,
                                              timeout_s: Optional[float] = None) -> dict:
        """Receive these tensors over the group (``weight_version`` None: keep the label, more batches
        follow); raises if the worker refused them."""
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "weight_version": None if weight_version is None else str(weight_version),
                "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        return await self._admin("/update_weights_from_distributed", body, timeout_s)

    async def update_weights_from_tensor(self, *, serialized_named_tensors: Sequence[str], load_format: Optional[str],
                                         weight_version: Optional[int], flush_cache: bool = True,
                                         timeout_s: Optional[float] = None) -> dict:
        """SGLang's /update_weights_from_tensor: one base64 pickled [(name, tensor)] entry per TP rank, applied by
        the loader ``load_format`` names (a --custom-weight-loader import path); raises if refused."""
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "weight_version": None if weight_version is None else str(weight_version), "flush_cache": flush_cache}
        return await self._admin("/update_weights_from_tensor", body, timeout_s)

    async def begin_weight_update(self, timeout_s: Optional[float] = None) -> dict:
        """Open SGLang's weight-update session (0.5.23 refuses /update_weights_from_distributed outside one)."""
        return await self._admin("/begin_weight_update", {}, timeout_s)

    async def end_weight_update(self, timeout_s: Optional[float] = None) -> dict:
        return await self._admin("/end_weight_update", {}, timeout_s)

    async def get_weights_by_name(self, name: str, *, truncate_size: int, timeout_s: Optional[float] = None) -> Any:
        """SGLang's read-back of one parameter: its first ``truncate_size`` rows as float32 lists."""
        return await self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str, timeout_s: Optional[float] = None) -> dict:
        return await self._admin("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout_s: Optional[float] = None) -> dict:
        """SGLang's ``/load_lora_adapter``: answers ``{success, error_message, loaded_adapters}`` (400 on failure,
        raised as InferenceError)."""
        return await self._call("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                                timeout_s=timeout_s)

    async def unload_lora_adapter(self, lora_name: str, timeout_s: Optional[float] = None) -> dict:
        return await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}, timeout_s=timeout_s)

    async def update_weight_version(self, new_version: int) -> dict:
        return await self._call("POST", "/update_weight_version", {"new_version": str(new_version)})


async def wait_until_ready(clients: Sequence[InferenceClient], deadline_s: float, *, poll_s: float = 0.5) -> None:
    """Poll /health_generate on every worker until all pass; PeerTimeout names the rest."""
    pending = {c.base_url: c for c in clients}
    last: dict[str, str] = {url: "not polled yet" for url in pending}
    deadline = time.monotonic() + deadline_s
    while pending:
        left = max(1.0, deadline - time.monotonic())
        results = await asyncio.gather(*(c.health_generate(timeout_s=min(c.timeout_s, left)) for c in pending.values()),
                                       return_exceptions=True)
        for url, r in zip(list(pending), results):
            if isinstance(r, BaseException):
                last[url] = str(r)[:300]
            else:
                del pending[url]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = "; ".join(f"{url} ({last[url]})" for url in pending)
            raise PeerTimeout(f"{len(pending)}/{len(clients)} inference workers not ready after {deadline_s:.0f}s: "
                              f"{names}")
        await asyncio.sleep(poll_s)
