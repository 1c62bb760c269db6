"""The embedded engine's weight-update routes, with SGLang's request and response fields.

  /update_weights_from_disk        {model_path, weight_version, load_format, abort_all_requests, flush_cache,
                                    allow_rollback (ours)}
  /init_weights_update_group       {master_address, master_port, rank_offset, world_size, group_name, backend}
  /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version, flush_cache,
                                    abort_all_requests, load_format}
  /destroy_weights_update_group    {group_name}

Each answers ``{success, message}`` (the disk route adds ``num_paused_requests``, as SGLang
does): 200 when applied, 400 with the reason when refused, in which case the engine keeps
the weights and version it had; 409 for a version older than the one served unless the
request says ``allow_rollback: true`` (our extension; SGLang has no such check). Our extension: an applied update also answers
``weights_digest`` (checksums.state_digest of every parameter), so the orchestrator can
check each update end to end against the trainer's digest.

What a route does with the parsed fields is the configured transport's business: each route
calls the receiver that ``weights.transport`` registers (TRANSPORTS, workers/weights/spec.py)
and copies the verified tensors it returns into the engine; a route the transport does not
use is refused (400). Protocols and who waits for whom: workers/weights/<transport>/__init__.py.
Blocking work (joining the group, receiving, reading files) runs in ``asyncio.to_thread``;
one update at a time per worker (an asyncio lock), so a second update waits for the first
instead of interleaving with it.

Wire format note: the broadcast transport's buckets are its own, not SGLang's per-tensor
broadcast; ``load_format`` must be null or ``slurmrl_buckets``, or ``slurmrl_delta`` for a sparse patch
applied in place (weights.delta: workers/weights/broadcast/delta_wire.py). The field names are
SGLang's, so the orchestrator's client is the same for both engines.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from aiohttp import web

from workers.common.config import WeightsConfig
from workers.common.registry import TRANSPORTS
from workers.inference.embedded.engine import InferenceEngine
from workers.inference.embedded.parsing import BadRequest, _bool, _int, _json, _version
from workers.weights.base import Received, TensorMeta, WeightLoadError
from workers.weights.lora_steps import is_adapter_step
from workers.weights.shards import BY_NAME

log = logging.getLogger("slurmrl.inference")
LOAD_FORMATS = (None, "slurmrl_buckets", "slurmrl_delta")


def _str(body: dict, field: str) -> str:
    v = body.get(field)
    if not isinstance(v, str) or not v:
        raise BadRequest(f"{field}: expected a non-empty string, got {v!r}"[:300])
    return v


def _refused(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=400)


def _backwards(engine: InferenceEngine, version: int, body: dict) -> Optional[web.Response]:
    """409 when ``version`` is older than what the engine serves and the caller did not ask for a
    rollback (``allow_rollback: true``, our extension: the orchestrator sets it when it deliberately
    brings a worker back to its own, older version); None to go on. Called under the update lock."""
    rollback = _bool(body.get("allow_rollback", False), "allow_rollback")
    if version >= engine.weight_version or rollback:
        return None
    return web.json_response({"success": False, "message": f"weight_version {version} goes backwards (serving "
                              f"v{engine.weight_version}); send allow_rollback=true to roll back on purpose"},
                             status=409)


def _announced(body: dict) -> list[TensorMeta]:
    """SGLang's parallel names / dtypes / shapes lists as TensorMeta (nbytes unused: 0)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise BadRequest("names, dtypes, shapes: expected three lists (one entry per tensor)")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"names, dtypes, shapes: {len(names)}, {len(dtypes)}, {len(shapes)} entries; must be equal")
    out = []
    for i, (n, d, s) in enumerate(zip(names, dtypes, shapes)):
        d = d.replace("torch.", "") if isinstance(d, str) else d
        if not isinstance(n, str) or not isinstance(d, str) or d not in BY_NAME:
            raise BadRequest(f"names[{i}], dtypes[{i}]: expected a name and one of {sorted(BY_NAME)}, got {n!r}, {d!r}")
        if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise BadRequest(f"shapes[{i}]: expected a list of non-negative ints, got {s!r}"[:300])
        out.append(TensorMeta(n, d, tuple(s), 0))
    return out


class WeightRoutes:
    """The four routes of one worker over its engine and the engine's receiver (module docstring).

    State: ``lock`` (one update at a time), ``group_name`` (the weight group joined, for the log and
    messages) and ``adapter_digest`` (LoRA mode: the digest of the adapter the last update loaded,
    ``""`` when it holds none; None when the last update was not an adapter)."""

    def __init__(self, engine: InferenceEngine, weights: Optional[WeightsConfig] = None):
        weights = weights if weights is not None else WeightsConfig()
        self.engine = engine
        device = next(engine.model.parameters()).device
        # the engine's own reader when it was built from this config (startup.py), so a worker has one
        self.receiver = engine.receiver_for(
            weights, lambda: TRANSPORTS.get(weights.transport).receiver(weights, device=device))
        self.lock = asyncio.Lock()
        self.group_name: Optional[str] = None
        self.adapter_digest: Optional[str] = None

    def routes(self) -> list[tuple[str, Any]]:
        return [("/update_weights_from_disk", self.update_weights_from_disk),
                ("/init_weights_update_group", self.init_weights_update_group),
                ("/update_weights_from_distributed", self.update_weights_from_distributed),
                ("/destroy_weights_update_group", self.destroy_weights_update_group)]

    def load_and_apply(self, path: str, version: int, abort_all: bool) -> int:
        engine = self.engine
        if abort_all:
            engine.abort(None, wait=True)
        if engine.lora is not None and is_adapter_step(path):  # LoRA mode: the base stays, the adapter changes
            n, digest = engine.load_adapter(path, version)
            self.adapter_digest = digest or ""  # "": nothing held, which confirms nothing
            return n
        self.adapter_digest = None
        return engine.update_weights_from_disk(path, version)

    async def update_weights_from_disk(self, request):
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path: expected the path of a published weights/step_N directory")
        version = _version(body, "weight_version")  # required: every token is tagged with it
        if body.get("load_format") is not None and not isinstance(body["load_format"], str):
            raise BadRequest("load_format: expected a string or null")
        abort_all = _bool(body.get("abort_all_requests", False), "abort_all_requests")
        _bool(body.get("flush_cache", True), "flush_cache")
        _bool(body.get("allow_rollback", False), "allow_rollback")
        engine = self.engine
        async with self.lock:
            if (refusal := _backwards(engine, version, body)) is not None:
                log.warning("refused weights %s: v%d goes backwards from v%d (no rollback asked)", path[:300],
                            version, engine.weight_version)
                return refusal
            try:
                n = await asyncio.to_thread(self.load_and_apply, path, version, abort_all)
            except WeightLoadError as e:
                log.warning("refused weights %s: %s (still serving v%d)", path, e, engine.weight_version)
                return _refused(str(e), num_paused_requests=engine.num_running + engine.num_pending)
            if self.adapter_digest is not None:  # the confirmation the orchestrator waits for (lora_coordinator.py)
                return web.json_response({"success": True, "message": f"Succeeded to load adapter v{version}.",
                                          "num_paused_requests": n, "adapter_digest": self.adapter_digest or None})
        return web.json_response({"success": True, "message": f"Succeeded to update model weights (v{version}).",
                                  "num_paused_requests": n,
                                  "weights_digest": await asyncio.to_thread(engine.weights_digest),
                                  # our extension: where the update's time went (weight_swap.py)
                                  "update_timing": {k: round(v, 5) for k, v in engine.update_timing.items()}})

    async def init_weights_update_group(self, request):
        body = await _json(request)
        kwargs = dict(master_address=_str(body, "master_address"),
                      master_port=_int(body.get("master_port"), "master_port", 1, 65535),
                      rank=_int(body.get("rank_offset"), "rank_offset", 0),
                      world_size=_int(body.get("world_size"), "world_size", 2),
                      group_name=_str(body, "group_name"), backend=body.get("backend", "nccl"))
        if kwargs["backend"] not in ("gloo", "nccl"):
            raise BadRequest(f"backend: {kwargs['backend']!r} is not one of 'gloo', 'nccl'")
        if kwargs["rank"] >= kwargs["world_size"]:
            raise BadRequest(f"rank_offset({kwargs['rank']}) must be < world_size({kwargs['world_size']})")
        async with self.lock:
            try:
                await asyncio.to_thread(self.receiver.join, **kwargs)
            except (TimeoutError, RuntimeError, ValueError) as e:
                log.warning("could not join weight group %s: %s", kwargs["group_name"], e)
                return _refused(str(e))
            self.group_name = kwargs["group_name"]
        log.info("joined weight group %s at %s:%d as rank %d of %d (%s)", self.group_name, kwargs["master_address"],
                 kwargs["master_port"], kwargs["rank"], kwargs["world_size"], kwargs["backend"])
        return web.json_response({"success": True, "message": f"joined weight group {self.group_name!r} as rank "
                                                              f"{kwargs['rank']} of {kwargs['world_size']}"})

    def receive_and_apply(self, version: int, announced: list[TensorMeta], name: str, abort_all: bool) -> str:
        engine = self.engine
        if abort_all:
            engine.abort(None, wait=True)
        got: Received = self.receiver.receive(version, announced, group_name=name, expected=engine.model.state_dict())
        n = engine.apply_received(got, version, source=f"broadcast:{name}")
        nbytes, seconds = got.bytes, got.seconds
        msg = (f"received v{version}: {nbytes / 1e6:.1f} MB in {seconds:.3f}s "
               f"({nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s), {n} requests in flight")
        log.info("%s", msg)
        return msg

    def receive_patch(self, version: int, name: str, abort_all: bool) -> str:
        engine = self.engine
        if abort_all:
            engine.abort(None, wait=True)
        nbytes, changed, seconds = self.receiver.receive_patch(
            version, group_name=name,
            apply_under_lock=lambda fn: engine.patch_weights(fn, version, source=f"broadcast:{name}"))
        msg = f"applied patch v{version}: {changed} elements changed, {nbytes / 1e6:.2f} MB in {seconds:.3f}s"
        log.info("%s", msg)
        return msg

    async def update_weights_from_distributed(self, request):
        body = await _json(request)
        announced = _announced(body)
        name = _str(body, "group_name")
        version = _version(body, "weight_version")
        abort_all = _bool(body.get("abort_all_requests", False), "abort_all_requests")
        _bool(body.get("flush_cache", True), "flush_cache")
        if body.get("load_format") not in LOAD_FORMATS:
            raise BadRequest(f"load_format: {body.get('load_format')!r} is not one of {list(LOAD_FORMATS)}")
        async with self.lock:
            try:
                if body.get("load_format") == "slurmrl_delta":
                    msg = await asyncio.to_thread(self.receive_patch, version, name, abort_all)
                else:
                    msg = await asyncio.to_thread(self.receive_and_apply, version, announced, name, abort_all)
            except (WeightLoadError, TimeoutError) as e:
                log.warning("refused broadcast v%d: %s (still serving v%d)", version, e, self.engine.weight_version)
                return _refused(str(e))
        return web.json_response({"success": True, "message": msg,
                                  "weights_digest": await asyncio.to_thread(self.engine.weights_digest)})

    async def destroy_weights_update_group(self, request):
        name = _str(await _json(request), "group_name")
        async with self.lock:
            try:
                self.receiver.leave(name)
            except WeightLoadError as e:
                return _refused(str(e))
            self.group_name = None
        return web.json_response({"success": True, "message": f"left weight group {name!r}"})


def weight_routes(engine: InferenceEngine, weights: Optional[WeightsConfig] = None) -> list[tuple[str, Any]]:
    """(path, handler) pairs for make_app, served by ``weights.transport``'s receiver
    (no config: the default transport with its defaults)."""
    return WeightRoutes(engine, weights).routes()
