"""A real inference server process (``python -m workers.inference``) recovering from bad
weights (issue 22):

- started next to a corrupt newest step, it serves the previous intact one and logs the
  step it skipped and why (it used to retry only the newest and crash-loop);
- an engine that crashes once new weights are live (a device fault, injected:
  tests/helpers/engine_fault.py) fails the request in flight with a 503 naming the reason,
  and the process exits with status 1 so the launcher or Slurm restarts it;
- a FIFO in place of a shard is refused at once (400), and SIGTERM still stops the server.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
import torch

from workers.common.inference_client import InferenceClient, InferenceError, wait_until_ready
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.weights.filesystem.publisher import publish_step
from tests.integration.conftest import TOKEN, SERVER_MODEL as MODEL, INIT_SEED, start_server

torch.set_num_threads(1)


def arun(fn):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await fn(session)
    return asyncio.run(main())


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_boot_skips_a_corrupt_newest_step_then_an_engine_crash_exits_1(tmp_path):
    model = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED)
    root = tmp_path / "weights"
    for step in (0, 1, 2):
        publish_step(root, step, {k: v * (1 + step / 10) for k, v in model.state_dict().items()}, keep_last=5)
    shard = root / "step_000002" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 0xFF
    shard.write_bytes(bytes(raw))
    proc, url, paths = start_server(tmp_path, fault_at_version=3)
    try:
        async def body(session):
            client = InferenceClient(url, TOKEN, session=session, timeout_s=30)
            await wait_until_ready([client], deadline_s=60)
            version = (await client.get_model_info())["weight_version"]
            publish_step(root, 3, {k: v * 1.3 for k, v in model.state_dict().items()}, keep_last=5)
            await client.update_weights_from_disk(str(root / "step_000003"), 3)
            t0 = time.monotonic()
            with pytest.raises(InferenceError) as e:
                await client.generate([1, 2, 3], temperature=1.0, max_new_tokens=8)
            return version, e.value.status, e.value.text, time.monotonic() - t0

        version, status, text, elapsed = arun(body)
        assert version == "1"
        assert status == 503 and "engine failed" in text and elapsed < 10
        assert proc.wait(20) == 1
    finally:
        stop(proc)
    log = (tmp_path / "inference.log").read_text()
    assert "skipping weights step 2: tensor" in log and "fails its checksum" in log
    assert "loaded weights step 1; skipped newer steps [2]" in log
    assert "exiting with status 1 so this worker is restarted" in log


def test_a_fifo_shard_is_refused_at_once_and_sigterm_still_stops(tmp_path):
    model = build_model(TinyMoeConfig(**MODEL), seed=INIT_SEED)
    root = tmp_path / "weights"
    publish_step(root, 0, model.state_dict(), keep_last=5)
    publish_step(root, 1, {k: v * 1.5 for k, v in model.state_dict().items()}, keep_last=5)  # read, not skipped
    fifo = root / "step_000001" / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    proc, url, paths = start_server(tmp_path)
    try:
        async def body(session):
            client = InferenceClient(url, TOKEN, session=session, timeout_s=30)
            await wait_until_ready([client], deadline_s=60)
            t0 = time.monotonic()
            with pytest.raises(InferenceError) as e:
                await client.update_weights_from_disk(str(root / "step_000001"), 1)
            return e.value.status, e.value.text, time.monotonic() - t0, (await client.get_model_info())["weight_version"]

        status, text, elapsed, version = arun(body)
        assert status == 400 and "not a regular file" in text and elapsed < 5 and version == "0"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        stop(proc)
    log = (tmp_path / "inference.log").read_text()
    assert "skipping weights step 1" in log  # at boot the FIFO step was skipped too, without blocking
