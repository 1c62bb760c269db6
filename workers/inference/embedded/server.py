"""HTTP front of the embedded engine, speaking SGLang's native API (aiohttp).

Why SGLang's wire format: the orchestrator drives SGLang servers (GPU) and this engine
(local runs) with one client, workers.common.inference_client. Routes, request and
response fields follow SGLang 0.5.x (srt/entrypoints/http_server.py, managers/io_struct.py):
``/generate`` answers ``output_ids`` + ``meta_info`` {id, finish_reason, prompt_tokens,
completion_tokens, output_token_logprobs [[logprob, id, null]], routed_experts (base64 of
int32 [seqlen-1-start, L, k]), weight_version (a string, as SGLang sends it)}, plus our
documented extension ``output_token_weight_versions`` (the version behind every token).

Threads: handlers never run torch. ``/generate`` submits to the engine thread and awaits a
future resolved via ``loop.call_soon_threadsafe``; calls that take the model lock (pause,
weight load) run in ``asyncio.to_thread``. State-changing routes need ``Authorization:
Bearer <run_dir/admin_token>``. Entry: :func:`run_server` (``python -m workers.inference``).

Failure and hygiene: when the engine loop crashes, every request in flight or queued is
answered 503 with the reason, /health turns 503, every other route but the read-only info
ones answers 503, and the process exits 1 so the launcher (launcher.max_restarts) or Slurm
restarts it. Disconnects, the admission queue (429), timeouts: guards.py.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import signal
import uuid
from typing import Any, Optional

from aiohttp import web

from workers.common.logs import get_logger
from workers.common.protocol import PeerTimeout, RunPaths, read_admin_token
from workers.inference.embedded import guards
from workers.inference.embedded.engine import GenOutput, GenRequest, InferenceEngine
from workers.inference.embedded.generate_request import parse_generate
from workers.inference.embedded.parsing import BODY_TIMEOUT, BadRequest, _bool, _json, _version
from workers.inference.embedded.startup import build_engine  # noqa: F401  (its home before; tools import it here)
from workers.inference.embedded.weight_routes import weight_routes
from workers.common.gc_pauses import settle as settle_gc
from workers.common.heartbeat import Heartbeat
from workers.weights.base import WeightLoadError

log = logging.getLogger("slurmrl.inference")

MAX_BODY_BYTES = 8 << 20
HEALTH_TIMEOUT_S = 20.0
def format_output(out: GenOutput, *, return_logprob: bool) -> dict:
    meta: dict[str, Any] = {
        "id": out.rid, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids), "cached_tokens": 0, "e2e_latency": out.latency_s,
        "weight_version": str(out.weight_version), "output_token_weight_versions": out.token_versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids)]
    if out.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(out.routed_experts.numpy().tobytes()).decode("ascii")
    return {"output_ids": out.output_ids, "meta_info": meta}


async def _stream(request: web.Request, outs: list[dict], is_batch: bool) -> web.StreamResponse:
    """SGLang's ``stream: true`` answer (server-sent events, ``data: [DONE]`` last). The engine
    does not stream tokens, so each request's one event is its complete output (SGLang's last
    chunk has the same fields); a batch tags each with ``index`` as SGLang does."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for i, out in enumerate(outs):
        await resp.write(b"data: " + json.dumps({**out, "index": i} if is_batch else out).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


READ_ONLY = {"/health", "/health_generate", "/get_model_info", "/model_info", "/server_info", "/get_server_info"}
"""Routes a failed engine still answers (health reports the failure; info is static)."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except web.HTTPException:
        raise
    except Exception as e:  # one bad request must never take the server down
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


async def _run(engine: InferenceEngine, reqs: list[GenRequest],
               disconnects: Optional[guards.Disconnects] = None, request: Optional[web.Request] = None
               ) -> list[GenOutput]:
    loop = asyncio.get_running_loop()
    futs = [loop.create_future() for _ in reqs]

    def resolver(fut: asyncio.Future):
        def on_done(out: GenOutput) -> None:  # engine thread: hand the result to the loop
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))
        return on_done

    key = disconnects.add(request, [r.rid for r in reqs]) if disconnects is not None else None
    for r, f in zip(reqs, futs):
        engine.submit(r, resolver(f))
    try:
        return list(await asyncio.gather(*futs))
    except asyncio.CancelledError:  # the server is stopping: free the batch slots
        engine.abort([r.rid for r in reqs], wait=False)
        raise
    finally:
        if key is not None:
            disconnects.discard(key)


def make_app(engine: InferenceEngine, *, admin_token: str, model_name: str, rank: int = 0,
             weights=None, extra_info: Optional[dict] = None, max_queued: int = 256) -> web.Application:
    """The aiohttp app; ``app["stop"]`` (an asyncio.Event set by /shutdown) ends run_server.
    ``weights`` (the run's weights config) picks the transport behind the weight routes; ``extra_info``:
    more fields of /get_model_info (a backend built on this server reports its own options there);
    ``max_queued``: the admission queue (inference.max_queued_requests; guards.admission_refusal)."""
    beat = Heartbeat()
    cfg = engine.config
    expected_auth = f"Bearer {admin_token}".encode()
    disconnects = guards.Disconnects(engine)

    @web.middleware
    async def auth(request: web.Request, handler):
        # Header bytes that are not UTF-8 arrive surrogate-escaped: compare them as the bytes sent.
        sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if request.path in admin_routes and not hmac.compare_digest(sent, expected_auth):
            return _error(401, f"{request.path} is an admin route: send 'Authorization: Bearer <run_dir/admin_token>'")
        return await handler(request)

    @web.middleware
    async def dead_engine(request: web.Request, handler):
        if engine.error is not None and request.path not in READ_ONLY:
            return _error(503, f"{engine.failure}; the server is exiting to be restarted")
        return await handler(request)

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors, auth, dead_engine])
    app.cleanup_ctx.append(disconnects.ctx)
    app[guards.DISCONNECTS] = disconnects

    async def generate(request):
        parsed = parse_generate(await _json(request), vocab_size=cfg.vocab_size, max_len=engine.max_seq_len,
                                adapters=None if engine.lora is None else engine.lora.names)
        busy = guards.admission_refusal(engine, len(parsed.reqs), max_queued)
        if busy is not None:
            return busy
        outs = await _run(engine, parsed.reqs, disconnects, request)
        failed = next((o.error for o in outs if o.error is not None), None)
        if failed is not None:  # the engine died under this request: an error, never tokens or a hang
            return _error(503, failed)
        formatted = [format_output(o, return_logprob=lp) for o, lp in zip(outs, parsed.return_logprob)]
        if parsed.stream:
            return await _stream(request, formatted, parsed.is_batch)
        return web.json_response(formatted if parsed.is_batch else formatted[0])

    async def health(request):
        return web.Response(status=200 if engine.alive else 503, text="" if engine.alive else "engine failed")

    async def health_generate(request):
        if not engine.alive:
            return _error(503, f"engine failed: {engine.error!r}")
        if engine.paused:  # a generate would wait for continue; the engine is fine
            return web.json_response({"status": "paused"})
        req = GenRequest(input_ids=[0], temperature=0.0, max_new_tokens=1, rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(_run(engine, [req]), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(503, f"a 1-token generate took over {HEALTH_TIMEOUT_S}s")
        return web.Response(text="")

    def model_info() -> dict:
        return {"model_path": engine.model_path, "served_model_name": model_name, "tokenizer_path": None,
                "is_generation": True, "model_name": model_name, "num_layers": cfg.num_routed_layers, "num_experts": cfg.num_experts,
                "top_k": cfg.top_k, "vocab_size": cfg.vocab_size, "weight_version": str(engine.weight_version),
                "max_position_embeddings": cfg.max_position_embeddings, **(extra_info or {})}

    async def get_model_info(request):
        return web.json_response(model_info())

    async def server_info(request):
        # heartbeat: this process's RSS and GPU memory/utilization (workers/common/heartbeat.py);
        # the orchestrator polls it into every batch's metrics (workers/orchestrator/batch_writer.py watch_inference)
        return web.json_response({**model_info(), "version": "slurmrl-embedded", "rank": rank, "heartbeat": beat.sample(),
                                  "max_batch_size": engine.max_batch_size, "paused": engine.paused,
                                  "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_pending,
                                  "num_generated_tokens": engine.num_generated_tokens, "num_steps": engine.num_steps,
                                  "dtype": str(next(engine.model.parameters()).dtype).replace("torch.", "")})

    async def pause_generation(request):
        mode = (await _json(request)).get("mode", "abort")  # SGLang's default mode
        if mode not in ("in_place", "retract", "abort"):
            raise BadRequest(f"mode: {mode!r} is not one of 'abort', 'retract', 'in_place'")
        n = await asyncio.to_thread(engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "num_paused_requests": n})

    async def continue_generation(request):
        await _json(request)  # no fields, but a malformed body is still the client's mistake (400)
        engine.resume()
        return web.json_response({"message": "Generation continued successfully."})

    async def flush_cache(request):
        # No prefix cache here: KV caches belong to running requests and leave with them.
        return web.Response(text="Cache flushed.")

    async def update_weight_version(request):
        body = await _json(request)
        version = _version(body, "new_version")
        if version < engine.weight_version and not _bool(body.get("allow_rollback", False), "allow_rollback"):
            return web.json_response({"success": False, "message": f"new_version {version} goes backwards (serving "
                                      f"v{engine.weight_version}); send allow_rollback=true to relabel on purpose"},
                                     status=409)
        if _bool(body.get("abort_all_requests", False), "abort_all_requests"):
            await asyncio.to_thread(engine.abort, None, wait=True)
        await asyncio.to_thread(engine.set_weight_version, version)
        return web.json_response({"success": True, "message": "Weight version updated.", "new_version": str(version)})

    async def abort_request(request):
        body = await _json(request)
        if _bool(body.get("abort_all", False), "abort_all"):
            await asyncio.to_thread(engine.abort, None, wait=True)
        elif isinstance(body.get("rid"), str):
            engine.abort([body["rid"]], wait=False)
        else:
            raise BadRequest("rid: expected a request id string (or abort_all: true)")
        return web.json_response({"success": True})

    async def shutdown(request):
        app["stop"].set()
        return web.json_response({"message": "shutting down"})

    posts = [("/generate", generate), ("/pause_generation", pause_generation),
             ("/continue_generation", continue_generation), ("/flush_cache", flush_cache),
             ("/abort_request", abort_request), ("/update_weight_version", update_weight_version),
             ("/shutdown", shutdown)]
    posts += weight_routes(engine, weights)
    app["stop"] = asyncio.Event()
    admin_routes = {path for path, _ in posts if path != "/generate"}  # every state-changing route
    for path, fn in [("/health", health), ("/health_generate", health_generate), ("/get_model_info", get_model_info),
                     ("/model_info", get_model_info), ("/server_info", server_info),
                     ("/get_server_info", server_info)]:
        app.router.add_get(path, fn)
    for path, fn in posts:
        app.router.add_post(path, fn)
    app.router.add_get("/flush_cache", flush_cache)  # SGLang serves it as GET and POST
    return app


async def _serve(app: web.Application, engine: InferenceEngine, host: str, port: int,
                 idle_timeout_s: float = 75.0) -> int:
    """Serve until a stop signal, /shutdown (exit code 0) or an engine crash (1)."""
    app[BODY_TIMEOUT] = idle_timeout_s
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=5.0,
                           **guards.runner_kwargs(idle_timeout_s))
    await runner.setup()
    await web.SockSite(runner, guards.listen(host, port)).start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app["stop"].set)
    log.info("serving on http://%s:%d (weights v%d, max_batch_size %d)", host, port, engine.weight_version,
             engine.max_batch_size)
    stop = asyncio.create_task(app["stop"].wait())
    while not stop.done() and engine.error is None:
        await asyncio.wait([stop], timeout=0.2)
    code = 0
    if engine.error is not None:  # every caller was answered 503 already (engine._loop)
        log.error("%s: exiting with status 1 so this worker is restarted", engine.failure)
        code = 1
    log.info("shutting down")
    stop.cancel()
    await asyncio.to_thread(engine.shutdown)  # in-flight requests answer with finish_reason abort
    await runner.cleanup()
    return code


class _Stopped(Exception):
    """SIGTERM/SIGINT before the event loop serves (waiting for weights, loading)."""


def _stop_on_signal(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def _run_loop(coro) -> int:
    """asyncio.run without its final wait for the default executor's threads: a thread stuck in
    a read must not keep a stopped server alive (guards.exit_watchdog then ends the process)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()  # shuts the executor down without waiting


def run_server(cfg, topology, *, extra_info: Optional[dict] = None) -> int:
    """Wait for weights, load the newest intact stable step as its version, serve until SIGTERM/SIGINT
    or /shutdown (exit 0) or an engine crash (exit 1, so it is restarted).

    A stop signal is a request, not a failure: exit 0 with one log line, in either phase.
    ``extra_info``: more /get_model_info fields (see make_app).
    """
    get_logger("inference", topology.rank, all_ranks=True)  # also prints this package's module loggers
    paths = RunPaths(topology.run_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):  # until the event loop installs its own handlers
        signal.signal(sig, _stop_on_signal)
    inf = cfg.inference
    try:
        token = read_admin_token(paths)
        engine = build_engine(cfg, topology.rank, topology.run_dir).start()
        app = make_app(engine, admin_token=token, model_name=cfg.model.name, rank=topology.rank,
                       weights=cfg.weights, extra_info=extra_info,
                       max_queued=getattr(inf, "max_queued_requests", 256))
        settle_gc(log, role="inference")  # the model, its graphs and the app live as long as the process
        code = _run_loop(_serve(app, engine, topology.bind_host, topology.bind_port,
                                getattr(inf, "idle_timeout_s", 75.0)))
    except _Stopped as e:
        log.info("stopped by %s before serving", e)
        code = 0
    except (PeerTimeout, OSError, WeightLoadError) as e:
        log.error("%s", e)
        code = 1
    guards.exit_watchdog(code)
    return code
