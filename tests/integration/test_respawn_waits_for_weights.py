"""Issue 47 item 3: a (re)started inference worker that finds no step it can load waits for one.

It used to exit at once (status 1), so a worker respawned while the only published chain was damaged used
up every restart although the trainer was about to write a full step. Now it waits for a step it has not
refused yet (a new one, or one written again) up to ``inference.startup_timeout_s``, then exits naming
every refusal (workers/inference/embedded/startup.py).
"""
from __future__ import annotations

import time

import pytest

from tests.integration.conftest import INIT_SEED, SERVER_MODEL as MODEL, start_server
from tests.integration.test_inference_recovery import arun, stop
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.filesystem.publisher import publish_step

pytestmark = pytest.mark.slow  # two server processes (~10-20 s)


def _damaged_step(root, step, state):
    publish_step(root, step, state, keep_last=5)
    shard = root / f"step_{step:06d}" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 0xFF
    shard.write_bytes(bytes(raw))


def _wait_log(path, text, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_a_worker_with_no_loadable_step_waits_for_the_next_good_one(tmp_path):
    state = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED).state_dict()
    root = tmp_path / "weights"
    _damaged_step(root, 0, state)
    proc, url, paths = start_server(tmp_path)
    try:
        _wait_log(tmp_path / "inference.log", "waiting up to 60s for the next one")
        assert proc.poll() is None  # still there, not restarted
        publish_step(root, 1, {k: v * 1.1 for k, v in state.items()}, keep_last=5)

        async def body(session):
            client = InferenceClient(url, "t", session=session, timeout_s=30)
            await wait_until_ready([client], deadline_s=60)
            return (await client.get_model_info())["weight_version"]

        assert arun(body) == "1"
    finally:
        stop(proc)
    log = (tmp_path / "inference.log").read_text()
    assert "skipping weights step 0" in log and "fails its checksum" in log


def test_the_wait_is_bounded_by_startup_timeout_and_names_every_refusal(tmp_path):
    state = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED).state_dict()
    _damaged_step(tmp_path / "weights", 0, state)
    proc, _, _ = start_server(tmp_path, startup_timeout_s=2)
    try:
        assert proc.wait(60) == 1
    finally:
        stop(proc)
    log = (tmp_path / "inference.log").read_text()
    assert "waiting up to 2s" in log and "no intact published weights step" in log and "step 0: tensor" in log
