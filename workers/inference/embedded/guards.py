"""Connection hygiene of the embedded server: disconnects, admission, timeouts, a sure exit.

Why a module of its own: these are the parts of server.py that protect the engine from its
clients rather than speak SGLang's API, and each answers one finding of a hostile test:

- aiohttp does not cancel a handler whose client went away (``handler_cancellation`` is off
  by default, and turning it on would also cancel weight loads half way). A generation whose
  client disconnected would run to ``max_new_tokens`` holding a batch slot.
  :class:`Disconnects` keeps the in-flight ``/generate`` requests and, every
  ``POLL_S``, aborts in the engine those whose transport has closed (one task for the whole
  server, not one timer per request).
- A burst of thousands of prompts queued in the engine delays every later request by the
  whole burst. :func:`admission_refusal` bounds the queue: beyond it ``/generate`` answers
  429 with Retry-After (the orchestrator's client backs off and retries within its deadline).
- Idle connections (keep-alive, or connected and silent) close after ``idle_timeout_s``
  (aiohttp's own default is an hour); a body that does not arrive in time is a 408
  (parsing._json); :func:`listen` turns on TCP keep-alive probes so a peer gone without a
  FIN is noticed within ~90 s.
- A malformed request is answered 400 by aiohttp, which logs it with a traceback quoting the
  client's bytes: :class:`OneLineBadRequests` makes that one bounded line.
- A stop must stop: :func:`exit_watchdog` ends the process when a worker thread (a read of
  a file that never ends) would otherwise keep it alive after the server shut down.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Optional

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError

log = logging.getLogger("slurmrl.inference")

POLL_S = 0.05
"""How often in-flight requests are checked for a closed connection (the abort's latency)."""
KEEPALIVE_PROBES = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}
"""A silent peer is probed after 60 s idle, every 10 s, and dropped after 3 missed probes."""
RETRY_AFTER_S = 1


class Disconnects:
    """The in-flight /generate requests; aborts those whose client has gone (see module doc)."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: dict[int, tuple[web.Request, list[str]]] = {}
        self.num_aborted = 0

    def add(self, request: web.Request, rids: list[str]) -> int:
        key = id(request)
        self.inflight[key] = (request, rids)
        return key

    def discard(self, key: int) -> None:
        self.inflight.pop(key, None)

    def sweep(self) -> int:
        """Abort the requests whose connection closed; returns how many."""
        gone = [k for k, (req, _) in self.inflight.items() if req.transport is None or req.transport.is_closing()]
        for k in gone:
            _, rids = self.inflight.pop(k)
            self.engine.abort(rids, wait=False)
            log.info("client of %s went away: aborted its generation", rids[0] if len(rids) == 1 else f"{len(rids)} prompts")
        self.num_aborted += len(gone)
        return len(gone)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if self.inflight:
                self.sweep()

    async def ctx(self, app: web.Application):
        """aiohttp cleanup context: the sweeper lives as long as the app serves."""
        task = asyncio.create_task(self.run())
        yield
        task.cancel()


DISCONNECTS = web.AppKey("disconnects", Disconnects)
"""``app[DISCONNECTS]``: the server's registry (tests read ``num_aborted``)."""


def admission_refusal(engine, num_new: int, max_queued: int) -> Optional[web.Response]:
    """429 (Retry-After) when ``num_new`` more prompts would overfill the queue; None to admit.

    The queue is the engine's pending requests (those running hold batch slots and are
    bounded by max_batch_size). A single request of more prompts than the limit could never
    be admitted: 400 naming the field instead of a 429 that would be retried forever.
    """
    if num_new > max_queued:
        return web.json_response({"error": {"message": f"input_ids: {num_new} prompts in one request exceed "
                                                       f"inference.max_queued_requests={max_queued}"}}, status=400)
    queued = engine.num_pending
    if queued + num_new <= max_queued:
        return None
    return web.json_response(
        {"error": {"message": f"server busy: {queued} prompts queued (inference.max_queued_requests={max_queued}); "
                              f"retry after {RETRY_AFTER_S}s"}},
        status=429, headers={"Retry-After": str(RETRY_AFTER_S)})


BAD_REQUEST_LOG_CHARS = 160
"""Longest excerpt of a malformed request's parse error in the log (it quotes the client's bytes)."""


class OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse with a full traceback whose message quotes up to
    8 KB of the client's header bytes; rewrite such a record to one line: the peer, the error's
    class and a bounded, printable excerpt (INFO for non-HTTP traffic, else WARNING)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            text = " ".join(str(exc.message or exc).split())
            text = "".join(ch if ch.isprintable() else "?" for ch in text)
            if len(text) > BAD_REQUEST_LOG_CHARS:
                text = text[:BAD_REQUEST_LOG_CHARS] + f"... ({len(text)} chars)"
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "bad HTTP request from %s: %s: %s (answered 400)", (
                peer, type(exc).__name__, text)
            record.exc_info, record.exc_text = None, None
            record.levelno = logging.INFO if isinstance(exc, BadHttpMethod) else logging.WARNING
            record.levelname = logging.getLevelName(record.levelno)
        return True


HTTP_LOG = logging.getLogger("slurmrl.inference.http")
"""The server connections' logger (aiohttp's ``aiohttp.server`` records, with :class:`OneLineBadRequests`)."""
HTTP_LOG.addFilter(OneLineBadRequests())


def runner_kwargs(idle_timeout_s: float) -> dict:
    """AppRunner settings, set explicitly (aiohttp's keep-alive default is an hour); after a
    refused or timed-out request whose body is unread, aiohttp drains it ("lingering") for
    at most the same bound (its default is 10 s), then closes. Connection errors go to
    :data:`HTTP_LOG` (one line per malformed request)."""
    return {"keepalive_timeout": float(idle_timeout_s), "tcp_keepalive": True,
            "lingering_time": min(float(idle_timeout_s), 5.0), "logger": HTTP_LOG}


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, with TCP keep-alive probes (Linux: accepted sockets inherit them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE_PROBES.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    sock.setblocking(False)
    return sock


def exit_watchdog(code: int, grace_s: float = 10.0) -> None:
    """Called by the server task once it stopped: if the interpreter's exit has not finished
    within ``grace_s`` (it joins every executor thread, and one may be stuck in a read that
    never ends), a daemon thread leaves with ``code`` instead of letting the process hang."""
    def bite() -> None:
        time.sleep(grace_s)
        busy = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon]
        log.error("still exiting after %.0fs (threads %s busy): leaving without them", grace_s, busy)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=bite, name="exit-watchdog", daemon=True).start()
