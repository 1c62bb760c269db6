"""Hostile weight routes and requests, second round (issue 35 item 7), on the real aiohttp app:

- a step whose STABLE marker is a directory (or a FIFO) is not a published step: the reader refuses
  it, and neither the boot scan nor the orchestrator's newest-step scan lists it;
- a weight version going backwards (v5 -> v2) is refused (409, old weights kept) unless the caller
  asks for a rollback (``allow_rollback``: the orchestrator does, reviving a worker that booted from
  a newer step than the one it serves);
- malformed HTTP requests (8 KB of header bytes, binary garbage) log one short line each in the
  server's log: no aiohttp traceback, no echo of the client's bytes beyond a bounded excerpt.
"""
from __future__ import annotations

import logging
import os

import pytest

from tests.integration.test_http_hostile import AUTH, MODEL, TOKEN, raw, serve
from workers.common.inference_client import InferenceClient, InferenceError
from workers.common.protocol import latest_stable_step
from workers.inference.embedded import guards
from workers.models.build import model_from_config
from workers.inference.embedded.startup import stable_steps
from workers.orchestrator.faults import WorkerPool
from workers.weights.base import WeightLoadError
from workers.weights.filesystem.publisher import publish_step
from workers.weights.filesystem.receiver import load_step


def _publish(root, steps):
    state = model_from_config(MODEL, "float32", "cpu").state_dict()
    for s in steps:
        publish_step(root, s, state, keep_last=50)
    return {s: root / f"step_{s:06d}" for s in steps}


@pytest.mark.parametrize("kind", ["dir", "fifo", "symlink"])
def test_a_stable_marker_that_is_not_a_regular_file_is_not_published(tmp_path, kind):
    dirs = _publish(tmp_path, [1, 2])
    marker = dirs[2] / "STABLE"
    marker.unlink()
    if kind == "dir":
        marker.mkdir()
    elif kind == "fifo":
        os.mkfifo(marker)
    else:
        marker.symlink_to(dirs[1] / "STABLE")
    with pytest.raises(WeightLoadError, match="STABLE"):
        load_step(dirs[2])
    assert [s for s, _ in stable_steps(tmp_path)] == [1]
    assert latest_stable_step(tmp_path) == 1


def test_a_version_going_backwards_is_refused_unless_a_rollback_is_asked(tmp_path):
    dirs = _publish(tmp_path, [2, 5])

    async def run(session, base, engine, app):
        out = {}
        for name, body in [("v5", {"model_path": str(dirs[5]), "weight_version": 5}),
                           ("v2", {"model_path": str(dirs[2]), "weight_version": 2}),
                           ("v5_again", {"model_path": str(dirs[5]), "weight_version": 5})]:
            async with session.post(base + "/update_weights_from_disk", json=body, headers=AUTH) as r:
                out[name] = (r.status, (await r.json())["message"], engine.weight_version)
        async with session.post(base + "/update_weight_version", json={"new_version": "1"}, headers=AUTH) as r:
            out["label_v1"] = (r.status, (await r.json()).get("message", ""), engine.weight_version)
        async with session.post(base + "/update_weights_from_disk", headers=AUTH,
                                json={"model_path": str(dirs[2]), "weight_version": 2, "allow_rollback": True}) as r:
            out["rollback_v2"] = (r.status, (await r.json())["message"], engine.weight_version)
        async with session.post(base + "/update_weights_from_disk", headers=AUTH,
                                json={"model_path": str(dirs[2]), "weight_version": 2, "allow_rollback": "yes"}) as r:
            out["bad_flag"] = (r.status, "", engine.weight_version)
        return out

    out = serve(run)
    assert out["v5"][0] == 200 and out["v5"][2] == 5
    assert out["v2"][0] == 409 and "backwards" in out["v2"][1] and out["v2"][2] == 5, out["v2"]
    assert out["v5_again"][0] == 200  # the same version again is not a rollback
    assert out["label_v1"][0] == 409 and out["label_v1"][2] == 5, out["label_v1"]
    assert out["rollback_v2"][0] == 200 and out["rollback_v2"][2] == 2, out["rollback_v2"]
    assert out["bad_flag"][0] == 400


def test_revival_rolls_a_worker_back_to_the_orchestrators_version(tmp_path):
    """A restarted worker boots from the newest STABLE step (v5) while the orchestrator serves v2:
    the revival asks for the rollback explicitly, and the worker then serves v2."""
    dirs = _publish(tmp_path, [2, 5])

    async def run(session, base, engine, app):
        client = InferenceClient(base, TOKEN, session=session, timeout_s=30)
        await client.update_weights_from_disk(str(dirs[5]), 5)
        with pytest.raises(InferenceError) as refused:
            await client.update_weights_from_disk(str(dirs[2]), 2)
        pool = WorkerPool([client], num_misses=1, timeout_s=10, log=logging.getLogger("test"))
        pool.mark_dead(0, "test")
        back = await pool.try_revive(0, lambda: (2, str(dirs[2])))
        return refused.value.status, back, engine.weight_version

    status, back, version = serve(run)
    assert status == 409 and back and version == 2


def test_malformed_http_requests_log_one_short_line_each(caplog):
    evil = b"X-Evil: " + b"\x1b[31m" + b"A" * 8100
    requests = [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\n" + evil + b"\r\n\r\n",
                b"GET /\x00\x01 HTTP/1.1\r\n\r\n", b"POST /generate HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\n\xff\xfe: y\r\n\r\n"]

    async def run(session, base, engine, app):
        answers = []
        for data in requests:
            got, _ = await raw(base, data, wait_s=3)
            answers.append(got.split(b"\r\n")[0])
        return answers

    with caplog.at_level(logging.DEBUG):
        answers = serve(run)
    assert all(b" 400 " in a for a in answers), answers
    records = [r for r in caplog.records if r.name.startswith(("aiohttp", "slurmrl"))
               and "request" in r.getMessage().lower() and r.levelno >= logging.INFO]
    assert len(records) == len(requests), [r.getMessage()[:120] for r in caplog.records]
    for r in records:
        assert r.exc_info is None and r.exc_text is None, "a traceback was logged"
        line = r.getMessage()
        assert "\n" not in line and len(line) <= guards.BAD_REQUEST_LOG_CHARS + 80, line
        assert "\x1b" not in line and "A" * 200 not in line
