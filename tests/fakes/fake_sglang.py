"""A fake SGLang 0.5.23 HTTP server: the real wire format, a trivial "model".

Why a fake: SGLang cannot serve on this CPU (docs/design.md, "Platform facts"), yet the orchestrator's
client must work unchanged against it. This server speaks SGLang's native routes with the
request/response shapes recorded from sglang 0.5.23 (srt/entrypoints/http_server.py and
srt/managers/io_struct.py; :data:`REQUEST_FIELDS` is checked against that source by
tests/unit/inference/test_fake_sglang_schema.py whenever sglang is installed), including where
SGLang differs from our embedded engine:

- ``/generate`` rejects fields GenerateReqInput does not have (SGLang raises on them);
  ``meta_info.weight_version`` is the server's string label; no per-token versions
  (``output_token_weight_versions`` is our engine's extension); ``routed_experts`` is
  base64 int32 ``[seqlen - 1 - start_len, L, k]`` only with --enable-return-routed-experts;
- ``/model_info`` (and the deprecated ``/get_model_info``) has no layer/expert counts;
- ``/health`` and ``/health_generate`` are 503 while starting, then 200 with an empty body;
- ``/flush_cache`` answers plain text; pause/continue answer ``{"message", "status"}``;
- ``--api-key`` guards every route (``Authorization: Bearer``), 401 otherwise;
- ``disaggregation_mode`` prefill/decode (a PD pair): both need bootstrap_host/port/room; the
  decode side waits until the prefill side has "sent" that room's KV (a registry in this
  process stands in for the KV bootstrap). Routing as the pinned PD path reports it: prefill
  rows ``[start, prompt_len)`` once the first token is appended
  (srt/disaggregation/prefill.py ``_maybe_collect_routed_experts``); decode rows ``[start,
  seqlen - 1)`` where prompt positions hold stale slots (:func:`stale_routing`), since the
  decode server never ran them.

- LoRA (``enable_lora``, SGLang's ``--enable-lora``): ``/load_lora_adapter`` {lora_name, lora_path} needs a
  PEFT directory and a new name and answers ``loaded_adapters``; ``/unload_lora_adapter``; ``/generate``
  refuses a ``lora_path`` that names no loaded adapter (400, SGLang's message). Several adapters are held
  at once and each is applied: a request naming one shifts every next token by :func:`lora_shift` of
  that adapter's safetensors bytes, so a test sees which adapter (and which version of it) answered.

The "model" is deterministic: the next token is ``(last + 1) % vocab``, its logprob
``-0.5``, its experts ``(position + j) % num_experts``; tests compute what to expect.
Every request is recorded (path, body, routing-key header) for assertions.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np
from aiohttp import web

SGLANG_VERSION = "0.5.23"
REQUEST_FIELDS = {
    "GenerateReqInput": {
        "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
        "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask",
        "sampling_logprobs_mode", "return_text_in_logprobs", "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream", "log_metrics",
        "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk",
        "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
        "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key",
        "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority",
        "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
        "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
        "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool",
        "cache_salt", "kv_hints"},
    "UpdateWeightFromDiskReqInput": {"rid", "http_worker_ipc", "model_path", "load_format", "abort_all_requests",
                                     "weight_version", "is_async", "torch_empty_cache", "keep_pause",
                                     "recapture_cuda_graph", "token_step", "flush_cache", "manifest"},
    "InitWeightsUpdateGroupReqInput": {"rid", "http_worker_ipc", "master_address", "master_port", "rank_offset",
                                       "world_size", "group_name", "backend"},
    "UpdateWeightsFromDistributedReqInput": {"rid", "http_worker_ipc", "names", "dtypes", "shapes", "group_name",
                                             "flush_cache", "abort_all_requests", "weight_version", "load_format",
                                             "selector", "torch_empty_cache"},
    "DestroyWeightsUpdateGroupReqInput": {"rid", "http_worker_ipc", "group_name"},
    "PauseGenerationReqInput": {"rid", "http_worker_ipc", "mode"},
    "ContinueGenerationReqInput": {"rid", "http_worker_ipc", "torch_empty_cache"},
    "UpdateWeightVersionReqInput": {"rid", "http_worker_ipc", "new_version", "abort_all_requests"},
    "BeginWeightUpdateReqInput": {"rid", "http_worker_ipc", "selector"},
    "EndWeightUpdateReqInput": {"rid", "http_worker_ipc"},
    "GetWeightsByNameReqInput": {"rid", "http_worker_ipc", "name", "truncate_size"},
    "UpdateWeightsFromTensorReqInput": {"rid", "http_worker_ipc", "serialized_named_tensors", "load_format",
                                        "flush_cache", "abort_all_requests", "weight_version", "selector",
                                        "torch_empty_cache"},
    "LoadLoRAAdapterReqInput": {"rid", "http_worker_ipc", "lora_name", "lora_path", "pinned", "lora_id"},
    "UnloadLoRAAdapterReqInput": {"rid", "http_worker_ipc", "lora_name", "lora_id"},
}
"""Field names of SGLang 0.5.23's request structs (io_struct.py; BaseReq adds rid, http_worker_ipc)."""
ROUTE_SCHEMA = {"/generate": "GenerateReqInput", "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
                "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
                "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
                "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
                "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
                "/update_weight_version": "UpdateWeightVersionReqInput",
                "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
                "/get_weights_by_name": "GetWeightsByNameReqInput",
                "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
                "/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput"}
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclasses.dataclass
class FakeSGLangConfig:
    vocab_size: int = 16
    num_layers: int = 2
    top_k: int = 2
    num_experts: int = 8
    api_key: Optional[str] = None
    enable_return_routed_experts: bool = False
    weight_version: str = "default"
    startup_s: float = 0.0
    """Seconds /health_generate answers 503 (the server is loading its weights)."""
    model_path: str = "/models/fake"
    disaggregation_mode: str = "null"
    """``null`` (unified), ``prefill`` or ``decode``."""
    enable_lora: bool = False
    """``--enable-lora``: /load_lora_adapter and /unload_lora_adapter serve PEFT directories by name, and
    /generate's ``lora_path`` must name a loaded adapter (SGLang's checks); off, loading is refused."""
    lora_load_noop: bool = False
    """Tests: /load_lora_adapter answers success but registers nothing (a broken delivery)."""


def lora_shift(adapter_dir, vocab: int) -> int:
    """The fake's "adapter": ``1 + xxh3(adapter_model.safetensors) % (vocab - 1)`` added to every next token
    (another adapter, or another version of it, answers other tokens)."""
    import xxhash

    data = (Path(adapter_dir) / "adapter_model.safetensors").read_bytes()
    return 1 + xxhash.xxh3_64_intdigest(data) % (vocab - 1)


def expected_output(input_ids: list[int], max_new_tokens: int, vocab: int, stop: tuple = (),
                    shift: int = 0) -> list[int]:
    out, last = [], input_ids[-1]
    for _ in range(max_new_tokens):
        last = (last + 1 + shift) % vocab
        out.append(last)
        if last in stop:
            break
    return out


def expected_routing(seqlen: int, start: int, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    pos = np.arange(start, seqlen - 1)[:, None, None]
    return ((pos + np.arange(num_layers)[None, :, None] + np.arange(top_k)[None, None, :]) % num_experts).astype("<i4")


def stale_routing(rows: np.ndarray, start: int, upto: int, num_experts: int) -> np.ndarray:
    """A decode server's rows for positions it never ran (< ``upto``): an earlier request's slots."""
    out = rows.copy()
    n = max(0, min(upto - start, len(out)))
    out[:n] = (out[:n] + 3) % num_experts
    return out


BOOTSTRAP: dict[tuple, asyncio.Future] = {}
"""(bootstrap_host, bootstrap_port, bootstrap_room) -> the prefill side's first token (fake KV transfer)."""


class FakeSGLang:
    def __init__(self, cfg: FakeSGLangConfig):
        self.cfg = cfg
        self.requests: list[dict] = []
        self.loras: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.lora_shifts: dict[str, int] = {}  # loaded LoRA adapters: name -> lora_shift of its weights
        self.paused: Optional[str] = None
        self.started = time.monotonic()
        self.groups: set[str] = set()
        self.app = web.Application(middlewares=[self._auth])
        r = self.app.router
        r.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weight_version", self.update_version)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/load_lora_adapter", self.load_lora)
        r.add_post("/unload_lora_adapter", self.unload_lora)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.cfg.api_key and request.headers.get("Authorization") != f"Bearer {self.cfg.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _body(self, request: web.Request) -> dict:
        body = await request.json() if request.can_read_body else {}
        schema = REQUEST_FIELDS[ROUTE_SCHEMA[request.path]]
        unknown = sorted(set(body) - schema)
        self.requests.append({"path": request.path, "body": body,
                              "routing_key": request.headers.get("x-smg-routing-key")})
        if unknown:  # SGLang's request dataclasses raise on unknown keyword arguments
            raise web.HTTPBadRequest(text=f"{ROUTE_SCHEMA[request.path]}.__init__() got an unexpected keyword "
                                          f"argument {unknown[0]!r}")
        return body

    async def health(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "body": None, "routing_key": None})
        if time.monotonic() - self.started < self.cfg.startup_s:
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.cfg.model_path, "served_model_name": "fake", "tokenizer_path": None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.cfg.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": "fake",
            "architectures": ["FakeForCausalLM"]})

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise web.HTTPBadRequest(text="input_ids must be a non-empty list of token ids")
        sp = body.get("sampling_params") or {}
        if body.get("lora_path") is not None and body["lora_path"] not in self.loras:
            return web.json_response({"error": {"message": f"The following requested LoRA adapters are not loaded: "
                                                           f"{body['lora_path']}"}}, status=400)
        while self.paused == "in_place":  # in-place pause: the request waits, its state kept
            await asyncio.sleep(0.01)
        out = expected_output(ids, int(sp.get("max_new_tokens", 16)), self.cfg.vocab_size,
                              tuple(sp.get("stop_token_ids") or ()), self.lora_shifts.get(body.get("lora_path"), 0))
        if self.cfg.disaggregation_mode != "null":
            return await self._generate_pd(body, ids, out)
        stopped = bool(out) and out[-1] in (sp.get("stop_token_ids") or ())
        finish = {"type": "stop", "matched": out[-1]} if stopped else {"type": "length", "length": len(out)}
        meta = {"id": body.get("rid") or uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
                "weight_version": self.cfg.weight_version, "completion_tokens": len(out), "cached_tokens": 0,
                "e2e_latency": 0.001}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [[-1.0, t, None] for t in ids[1:]]
        if body.get("return_routed_experts") and self.cfg.enable_return_routed_experts:
            start = int(body.get("routed_experts_start_len") or 0)
            arr = expected_routing(len(ids) + len(out), start, self.cfg.num_layers, self.cfg.top_k,
                                   self.cfg.num_experts)
            meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def _generate_pd(self, body: dict, ids: list[int], out: list[int]) -> web.Response:
        room = tuple(body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
        if None in room:
            raise web.HTTPBadRequest(text="disaggregated server: bootstrap_host/port/room are required")
        slot = BOOTSTRAP.setdefault(room, asyncio.get_running_loop().create_future())
        routed = body.get("return_routed_experts") and self.cfg.enable_return_routed_experts
        start = int(body.get("routed_experts_start_len") or 0)
        c = self.cfg
        meta = {"id": body.get("rid") or uuid.uuid4().hex, "prompt_tokens": len(ids), "cached_tokens": 0,
                "weight_version": c.weight_version, "e2e_latency": 0.001}
        if c.disaggregation_mode == "prefill":
            slot.set_result(out[:1])  # the KV (and the first token) go to the decode side
            meta.update(finish_reason={"type": "length", "length": 0}, completion_tokens=len(out[:1]))
            if routed:  # seqlen = prompt + the first token: rows [start, prompt_len)
                arr = expected_routing(len(ids) + 1, start, c.num_layers, c.top_k, c.num_experts)
                meta["routed_experts"] = base64.b64encode(arr.tobytes()).decode()
            return web.json_response({"output_ids": out[:1], "meta_info": meta})
        first = await asyncio.wait_for(slot, 30)  # decode: wait for the prefill side's transfer
        BOOTSTRAP.pop(room, None)
        assert first == out[:1], (first, out)
        stopped = bool(out) and out[-1] in (body["sampling_params"].get("stop_token_ids") or ())
        meta.update(finish_reason={"type": "stop", "matched": out[-1]} if stopped else
                    {"type": "length", "length": len(out)}, completion_tokens=len(out))
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        if routed:
            arr = expected_routing(len(ids) + len(out), start, c.num_layers, c.top_k, c.num_experts)
            meta["routed_experts"] = base64.b64encode(stale_routing(arr, start, len(ids), c.num_experts)
                                                      .tobytes()).decode()
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "body": None, "routing_key": None})
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def pause(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise web.HTTPBadRequest(text=f"mode must be one of {PAUSE_MODES}")
        self.paused = mode
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.paused = None
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not str(body.get("model_path", "")).startswith("/"):
            return web.json_response({"success": False, "message": "Failed to get weights iterator",
                                      "num_paused_requests": 0}, status=400)
        if body.get("weight_version") is not None:
            self.cfg.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.cfg.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.groups.add(body["group_name"])
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("group_name") not in self.groups:
            return web.json_response({"success": False, "message": f"group {body.get('group_name')} not found"},
                                     status=400)
        if body.get("weight_version") is not None:
            self.cfg.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.groups.discard(body.get("group_name"))
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def load_lora(self, request: web.Request) -> web.Response:
        """SGLang's LoRAUpdateOutput: ``loaded_adapters`` {name: path} after the load; 400 on failure."""
        body = await self._body(request)
        name, path = body.get("lora_name"), str(body.get("lora_path", ""))
        why = ("LoRA is not enabled (--enable-lora)" if not self.cfg.enable_lora else
               f"LoRA adapter {name} is already loaded" if name in self.loras else
               f"{path} has no adapter_config.json" if not (Path(path) / "adapter_config.json").is_file() else
               f"{path} has no adapter_model.safetensors" if not (Path(path) / "adapter_model.safetensors").is_file()
               else None)
        if why is not None:
            return web.json_response({"success": False, "error_message": why, "loaded_adapters": dict(self.loras)},
                                     status=400)
        if not self.cfg.lora_load_noop:
            self.loras[name], self.lora_shifts[name] = path, lora_shift(path, self.cfg.vocab_size)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loras)})

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.lora_shifts.pop(body.get("lora_name"), None)
        if self.loras.pop(body.get("lora_name"), None) is None:
            return web.json_response({"success": False, "error_message": f"LoRA with name {body.get('lora_name')} "
                                      f"does not exist", "loaded_adapters": dict(self.loras)}, status=400)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loras)})

    def close(self) -> None:
        """Nothing to release here (serve_fake calls it; fake_sglang_weights stops its rank processes)."""


@contextlib.asynccontextmanager
async def serve_fake_sglang(cfg: FakeSGLangConfig, host: str = "127.0.0.1"):
    """Run a FakeSGLang on a free loopback port; yields (url, server)."""
    async with serve_fake(FakeSGLang(cfg), host) as url_and_fake:
        yield url_and_fake


@contextlib.asynccontextmanager
async def serve_fake(fake: FakeSGLang, host: str = "127.0.0.1"):
    """Serve ``fake`` (a FakeSGLang or a subclass) on a free loopback port; yields (url, fake).
    On exit the HTTP side stops first, then ``fake.close()`` releases what it started (off the
    event loop: a subclass may join processes)."""
    runner = web.AppRunner(fake.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}", fake
    finally:
        await runner.cleanup()
        await asyncio.to_thread(fake.close)
