"""Several LoRA adapters on SGLang servers (``trainer.lora.adapters``, issue 44 item 5), against the fake SGLang.

Each published version holds one PEFT directory per adapter (``step_V/adapters/<name>/``); the
coordinator loads each as ``<name>@v<V>`` through SGLang's ``/load_lora_adapter``, confirms V on a
server only when SGLang's answer lists every one of them, and a request for adapter ``a`` is then sent
as ``lora_path=a@v<V>``. The fake applies each loaded adapter (a token shift computed from its
safetensors bytes), so the tokens a request gets back show which adapter, at which version, answered.
"""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from tests.fakes.fake_sglang import FakeSGLangConfig, expected_output, lora_shift, serve_fake_sglang
from workers.common.inference_client import InferenceClient, InferenceError
from workers.common.protocol import RunPaths
from workers.orchestrator.adapters import NamedAdapterClient
from workers.orchestrator.faults import WorkerPool
from workers.weights.base import SoloPeers
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.lora_coordinator import AdapterClient, SGLangLoraCoordinator
from workers.weights.lora_format import Adapter
from workers.weights.lora_publisher import AdapterPublisher

NAMES = ["short", "long"]
CFG = SimpleNamespace(weights=SimpleNamespace(verify=False), inference=SimpleNamespace(dtype="float32"),
                      trainer=SimpleNamespace(dtype="float32", lora=SimpleNamespace(rank=2, alpha=4, targets=["q_proj"],
                                                                                    adapters=NAMES)))
VOCAB, PROMPT, N = 16, [3, 5], 4
log = logging.getLogger("test.sglang_lora_adapters")


def adapter(s: float) -> Adapter:
    return Adapter({"model.layers.0.self_attn.q_proj": (torch.full((2, 4), s), torch.full((4, 2), s))}, rank=2, alpha=4)


def tokens_of(step_dir, name: str) -> list[int]:
    """What the fake answers PROMPT with under adapter ``name`` of ``step_dir``."""
    return expected_output(PROMPT, N, VOCAB, shift=lora_shift(step_dir / "adapters" / name, VOCAB))


def test_sglang_servers_serve_several_adapters_by_versioned_name(tmp_path, caplog):
    paths = RunPaths(tmp_path)
    root = paths.root / "weights"
    pub = AdapterPublisher(FilesystemPublisher(root, peers=SoloPeers(), keep_last=5), root, peers=SoloPeers(),
                           keep_last=5)
    pub.publish(0, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)})
    step = lambda v: root / f"step_{v:06d}"

    async def run():
        async with serve_fake_sglang(FakeSGLangConfig(enable_lora=True, vocab_size=VOCAB)) as (u0, fake0), \
                serve_fake_sglang(FakeSGLangConfig(enable_lora=True, vocab_size=VOCAB, lora_load_noop=True)) as (u1, _):
            async with aiohttp.ClientSession() as session:
                clients = [InferenceClient(u, "", session=session, timeout_s=10) for u in (u0, u1)]
                pool = WorkerPool(clients, num_misses=3, timeout_s=5, log=log)
                coord = SGLangLoraCoordinator(CFG, paths, log=log)

                async def ask(name: str):  # the loop's composition: client_for(AdapterClient(...), task, adapters)
                    client = NamedAdapterClient(AdapterClient(clients[0], coord), name)
                    return await client.generate(PROMPT, temperature=1.0, max_new_tokens=N)

                out = {"base": await ask("short")}
                pub.publish(1, {"short": adapter(0.1), "long": adapter(0.2)})
                await coord.maybe_update(pool)
                out["v1"] = (coord.version, dict(coord.quarantined), dict(fake0.loras))
                out["short1"], out["long1"] = await ask("short"), await ask("long")
                with pytest.raises(ValueError, match=r"'other': this run trains \['short', 'long'\]"):
                    await ask("other")
                with pytest.raises(InferenceError, match="not loaded: other@v1"):  # SGLang's own refusal
                    await clients[0].generate(PROMPT, temperature=1.0, max_new_tokens=N, extra={"lora_path": "other@v1"})
                pub.publish(2, {"short": adapter(0.3), "long": adapter(0.4)})
                await coord.maybe_update(pool)
                await asyncio.sleep(0.2)  # the replaced names are unloaded in the background
                out["v2"] = (coord.version, dict(fake0.loras))
                out["short2"] = await ask("short")
                # v3 with one adapter missing its weights: no server may serve half a version
                pub.publish(3, {"short": adapter(0.5), "long": adapter(0.6)})
                (step(3) / "adapters" / "long" / "adapter_model.safetensors").unlink()
                await coord.maybe_update(pool)
                out["v3"] = (coord.version, dict(fake0.loras), (await ask("long")).token_versions)
                pool.mark_dead(0, "test: a restart")
                fake0.loras.clear()  # a restarted server holds the base alone
                assert await coord.revive(pool, 0, None) and pool.alive[0]
                out["revived"] = dict(fake0.loras)
                out["sent"] = [r["body"].get("lora_path") for r in fake0.requests if r["path"] == "/generate"]
                return out

    with caplog.at_level(logging.ERROR, logger=log.name):
        out = asyncio.run(run())
    assert out["base"].token_versions == [0] * N and out["base"].output_ids == expected_output(PROMPT, N, VOCAB)
    v1, quarantined, loaded = out["v1"]
    assert v1 == 1 and loaded == {"short@v1": str(step(1) / "adapters" / "short"),
                                  "long@v1": str(step(1) / "adapters" / "long")}
    assert quarantined == {1: 1} and "NOT confirmed by inference worker 1" in caplog.text
    assert "short@v1, long@v1 not among its loaded adapters" in caplog.text
    # each request is answered by its own adapter at the confirmed version (and the two differ)
    assert out["short1"].output_ids == tokens_of(step(1), "short") != tokens_of(step(1), "long")
    assert out["long1"].output_ids == tokens_of(step(1), "long") and out["long1"].token_versions == [1] * N
    v2, loaded2 = out["v2"]
    assert v2 == 2 and sorted(loaded2) == ["long@v2", "short@v2"]  # v1's names unloaded
    assert out["short2"].output_ids == tokens_of(step(2), "short") and out["short2"].weight_version == 2
    v3, loaded3, long_versions = out["v3"]
    assert v3 == 2 and sorted(loaded3) == ["long@v2", "short@v2"]  # short@v3 was loaded, then dropped again
    assert long_versions == [2] * N and "long@v3" in caplog.text
    assert sorted(out["revived"]) == ["long@v2", "short@v2"]
    assert out["sent"] == [None, "short@v1", "long@v1", "other@v1", "short@v2", "long@v2"]
