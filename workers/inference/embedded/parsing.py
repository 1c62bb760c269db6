"""Request-body checks shared by the embedded server's routes (server.py, weight_routes.py).

Why a module of its own: both route modules parse SGLang's JSON fields the same way and
answer 400 with the field named; keeping the helpers here lets weight_routes.py use them
without importing server.py, which imports weight_routes.py (no import cycle).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from aiohttp import web


class BadRequest(ValueError):
    """A client mistake; the message names the field."""


def _int(v: Any, field: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{field}: expected an integer, got {type(v).__name__} {v!r}"[:300])
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{field}: {v} is outside [{lo}, {hi}]")
    return v


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{field}: expected true/false, got {v!r}"[:300])
    return v


BODY_TIMEOUT_S = 75.0
"""Default deadline for a request body to arrive (the server sets ``app[BODY_TIMEOUT]``)."""
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


async def _json(request: web.Request) -> dict:
    """The JSON object body; 400 naming ``body`` when it is not one (too deep nesting included),
    408 when it does not arrive in time (a client that sent headers and stalled)."""
    timeout = request.app.get(BODY_TIMEOUT, BODY_TIMEOUT_S)
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"body: not received within {timeout:.0f}s") from None
    try:
        body = json.loads(raw) if raw.strip() else {}  # SGLang clients post some routes bodiless
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None
    except ValueError as e:
        raise BadRequest(f"body: not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    return body


def _version(body: dict, field: str) -> int:
    v = body.get(field)
    if isinstance(v, str) and v.isascii() and v.strip().lstrip("-").isdigit() and len(v) <= 20:
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63:  # an int64, as SGLang's
        return v
    raise BadRequest(f"{field}: expected an integer (as a number or a string), got {v!r}"[:300])
