"""Sparse patches over the filesystem into SGLang servers, each rank pulling only what it holds, end to end on CPU.

Two fake SGLang servers (tests/fakes/fake_sglang_weights.py: one process per TP rank, HTTP as SGLang 0.5.23)
whose ranks hold SGLang's expert-parallel layout (2 of the 4 routed experts each, stacked like FusedMoE:
tests/fakes/fake_sglang_moe.py, a different placement per server); the real trainer side (PatchPublisher
writing anchors and patch steps to run_dir/weights) and the real orchestrator side
(FilesystemSGLangCoordinator, the real WorkerPool).

Checks: a patch step reaches every server as a descriptor (no /update_weights_from_disk of a patch step,
which SGLang cannot load), every rank reads exactly the patch bytes of the tensors it holds (its verdict's
bytes_read = the sum of those tensors' parts, less than the whole patch) and ends bit for bit at the
trainer's weights; an anchor is loaded from disk; versions published between two loop turns are pulled in
order; a rank that no longer holds the base refuses and its server loads the anchor and pulls again; a
patch refused even on the anchor makes the server load the resolved step; a revived server loads the
anchor and catches up by patches at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import types

import aiohttp
import torch

from tests.fakes.fake_sglang_moe import EXPERT
from tests.fakes.fake_sglang_weights import FakeWeightsConfig, serve_fake_sglang_weights
from tests.unit.weights.test_sglang_pull import part_bytes
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths, step_name
from workers.orchestrator.faults import WorkerPool
from workers.weights.base import SoloPeers
from workers.weights.sglang.wire import DELTA_LOADER
from workers.weights.delta.config import DeltaWeightsConfig
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.sglang.pull_coordinator import PULL_DIR, FilesystemSGLangCoordinator
from workers.weights.stream import DictStream

torch.set_num_threads(1)
TP, EXPERTS = 2, 4
PLACEMENTS = ([[0, 1], [2, 3]], [[0, 2], [1, 3]])  # per server: the experts each TP rank holds


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small HF-named MoE model (fp32 master weights): attention, router, 4 routed experts, embeddings."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (64, 32), "model.layers.0.self_attn.q_proj.weight": (32, 32),
              "model.layers.0.mlp.gate.weight": (EXPERTS, 32), "lm_head.weight": (64, 32)}
    for e in range(EXPERTS):
        shapes |= {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": (48, 32),
                   f"model.layers.0.mlp.experts.{e}.up_proj.weight": (48, 32),
                   f"model.layers.0.mlp.experts.{e}.down_proj.weight": (32, 48)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def bf16(state):
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


def nudge(master, step, fraction=0.02):
    g = torch.Generator().manual_seed(1000 + step)
    for t in master.values():
        flat = t.reshape(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(fraction * flat.numel()))]
        flat[idx] += torch.randn(idx.numel(), generator=g) * 0.1


def holds(name: str, experts) -> bool:
    m = EXPERT.match(name)
    return m is None or int(m["expert"]) in experts


class Run:
    """The run's pieces the checks need (publisher, servers, coordinator, pool)."""

    def __init__(self, tmp_path):
        self.paths = RunPaths(tmp_path)
        self.root = self.paths.root / "weights"
        self.master = model_state()
        self.pub = PatchPublisher(FilesystemPublisher(self.root, peers=SoloPeers(), keep_last=20), full_every=6,
                                  publish_async=False)

    def publish(self, v: int) -> None:
        if v:
            nudge(self.master, v)
        self.pub.publish(v, DictStream(self.master, dtype=torch.bfloat16))
        index = json.loads((self.root / step_name(v) / "index.json").read_text())
        if index.get("format") != "slurmrl-delta/1":
            (self.root / step_name(v) / "config.json").write_text("{}")  # what a family with an HF config writes

    def index(self, v: int) -> dict:
        return json.loads((self.root / step_name(v) / "index.json").read_text())


def route(requests) -> list[str]:
    return [r["path"] for r in requests]


def disk_loads(fake, requests) -> list[str]:
    """model_path of every /update_weights_from_disk among ``requests``."""
    return [r["body"]["model_path"] for r in requests if r["path"] == "/update_weights_from_disk"]


async def check_ranks(run: Run, fakes, v: int) -> None:
    want = bf16(run.master)
    for fake, placement in zip(fakes, PLACEMENTS):
        assert fake.cfg.weight_version == str(v), (fake.cfg.weight_version, v)
        for r in range(TP):
            got = await asyncio.to_thread(fake.rank_state, r)
            assert set(got) == {n for n in want if holds(n, placement[r])}
            bad = [n for n, t in got.items() if not torch.equal(t.view(torch.int16), want[n].view(torch.int16))]
            assert not bad, (v, r, bad[:3])


def check_shares(run: Run, v: int, servers=(0, 1)) -> None:
    """Every rank's verdict on v: it read exactly its tensors' parts, less than the whole patch."""
    index = run.index(v)
    whole = sum(part_bytes(p) for m in index["tensors"].values() for p in m["parts"])
    for s in servers:
        shares = sorted(sum(part_bytes(p) for n, m in index["tensors"].items() if holds(n, experts)
                            for p in m["parts"]) for experts in PLACEMENTS[s])
        files = sorted((run.paths.root / PULL_DIR / "verdicts" / str(s)).glob(f"v{v}.*.json"))
        got = [json.loads(f.read_text()) for f in files]
        assert all(g["ok"] for g in got), got
        assert sorted(g["bytes_read"] for g in got) == shares, (v, s, got, shares)
        assert max(shares) < whole, (shares, whole)


async def scenario(tmp_path):
    run = Run(tmp_path)
    run.publish(0)
    weights = DeltaWeightsConfig(delta=True, delta_full_every=6, publish_async=False)
    cfg = types.SimpleNamespace(weights=weights, orchestrator=types.SimpleNamespace(weight_update_timeout_s=60),
                                inference=types.SimpleNamespace(num_workers=2, worker=types.SimpleNamespace(tp=TP)))
    log = logging.getLogger("test_sglang_pull")
    fake = [FakeWeightsConfig(state=bf16(run.master), tp_size=TP, custom_weight_loader=[DELTA_LOADER],
                              ep_experts=p) for p in PLACEMENTS]
    async with serve_fake_sglang_weights(fake[0]) as (u0, f0), serve_fake_sglang_weights(fake[1]) as (u1, f1), \
            aiohttp.ClientSession() as session:
        clients = [InferenceClient(u, "tok", session=session, timeout_s=60) for u in (u0, u1)]
        pool = WorkerPool(clients, num_misses=3, timeout_s=10, log=log)
        coord = FilesystemSGLangCoordinator(cfg, run.paths, log=log)
        await coord.start(clients)

        async def step(*versions):
            for v in versions:
                run.publish(v)
            n = [len(f.requests) for f in (f0, f1)]
            await coord.maybe_update(pool)
            assert coord.version == versions[-1]
            await check_ranks(run, (f0, f1), versions[-1])
            return [f.requests[k:] for f, k in zip((f0, f1), n)]

        for v in (1, 2, 3):
            seen = await step(v)
            for paths in map(route, seen):
                assert paths.count("/update_weights_from_tensor") == 1 and "/update_weights_from_disk" not in paths
            check_shares(run, v)
        assert coord.verified == 3 and coord.fallbacks == 0  # per update: every rank of every server verified
        for paths in map(route, await step(4, 5)):  # two versions between loop turns: pulled in order
            assert paths.count("/update_weights_from_tensor") == 2 and "/update_weights_from_disk" not in paths
        check_shares(run, 4)
        check_shares(run, 5)
        for paths in map(route, await step(6)):  # an anchor: a full step, loaded from disk
            assert "/update_weights_from_disk" in paths and "/update_weights_from_tensor" not in paths

        # a rank of server 1 no longer holds the base: it refuses, server 1 loads the anchor (v6) and pulls again
        await asyncio.to_thread(f1.ranks[1].call, "load_disk", {"model_path": str(run.paths.weights(0))})
        seen = await step(7)
        assert coord.fallbacks == 1 and coord.mismatched == 1
        assert route(seen[0]).count("/update_weights_from_tensor") == 1 and not disk_loads(f0, seen[0])
        assert disk_loads(f1, seen[1]) == [str(run.paths.weights(6))] and route(seen[1]).count("/update_weights_from_tensor") == 2

        # ... and once more, with its anchor spoiled as it loads (a patch refused on the anchor): the resolved v8
        await asyncio.to_thread(f1.ranks[1].call, "load_disk", {"model_path": str(run.paths.weights(0))})
        await asyncio.to_thread(f1.ranks[1].call, "corrupt_next", {"name": "lm_head.weight"})
        seen = await step(8)
        assert coord.fallbacks == 2 and coord.mismatched == 2
        resolved = str(run.paths.root / PULL_DIR / "resolved" / step_name(8))
        assert disk_loads(f1, seen[1]) == [str(run.paths.weights(6)), resolved]
        assert "/update_weights_from_tensor" in route((await step(9))[1])  # server 1 pulls again: it holds v8

        # server 0 dies and comes back holding stale weights: it loads the anchor (v6) and pulls 7..9 at once
        for r in range(TP):
            await asyncio.to_thread(f0.ranks[r].call, "load_disk", {"model_path": str(run.paths.weights(0))})
        pool.alive[0] = False
        n = len(f0.requests)
        assert await coord.revive(pool, 0, lambda: (coord.version, str(run.paths.weights(coord.version))))
        assert disk_loads(f0, f0.requests[n:]) == [str(run.paths.weights(6))] and pool.alive[0]
        assert route(f0.requests[n:]).count("/update_weights_from_tensor") == 3
        await check_ranks(run, (f0, f1), 9)
        seen = await step(10)
        for paths in map(route, seen):
            assert paths.count("/update_weights_from_tensor") == 1 and "/update_weights_from_disk" not in paths
        run.pub.close()
        return coord


def test_each_rank_pulls_only_its_share_and_refusals_fall_back_to_full_steps(tmp_path):
    coord = asyncio.run(scenario(tmp_path))
    assert coord.version == 10 and coord.fallbacks == 2
