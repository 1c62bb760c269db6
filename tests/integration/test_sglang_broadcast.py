"""Broadcast into SGLang servers, end to end without GPUs: two fake SGLang servers with 2 TP ranks
each (tests/fakes/fake_sglang_weights.py: one process per rank, receiving on gloo exactly as the
pinned sglang does), the real orchestrator side (SGLangBroadcastCoordinator over InferenceClient)
and the real trainer side (SGLangBroadcastPublisher, in a thread as the trainer loop runs it).

Checks: every rank of both servers holds the trainer's weights bit for bit after an update (in
inference.dtype, both wire formats); the calls come in SGLang's order (pause, begin, batches with
weight_version on the last only, end, read-back, continue) at the right rank offsets; a tensor
spoiled on a server is caught by the read-back and the version arrives through the filesystem.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import types

import aiohttp
import pytest
import torch

from tests.fakes.fake_sglang_weights import FakeWeightsConfig, serve_fake_sglang_weights
from workers.common.inference_client import InferenceClient
from workers.common.protocol import RunPaths, latest_stable_step
from workers.weights.base import SoloPeers
from workers.weights.broadcast import BroadcastWeightsConfig
from workers.weights.sglang.broadcast_coordinator import SGLangBroadcastCoordinator
from workers.weights.sglang.broadcast_publisher import SGLangBroadcastPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher

torch.set_num_threads(1)
TP, SERVERS = 2, 2


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """A small HF-named state (fp32 master weights), shaped like a MoE layer's."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (256, 1024), "model.layers.0.self_attn.q_proj.weight": (512, 1024),
              "model.layers.0.mlp.experts.0.gate_proj.weight": (256, 1024),
              "model.layers.0.mlp.experts.1.gate_proj.weight": (256, 1024),
              "model.layers.0.mlp.gate.weight": (2, 1024), "model.norm.weight": (1024,), "lm_head.weight": (256, 1024)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def bf16(state):
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


class Trainer:
    """Trainer rank 0 publishing in a thread (the real loop blocks in publish as well)."""

    def __init__(self, paths: RunPaths, weights: BroadcastWeightsConfig):
        self.pub = SGLangBroadcastPublisher(paths, weights, SoloPeers(), initial=FilesystemPublisher(
            paths.root / "weights", peers=SoloPeers(), keep_last=5), host="127.0.0.1", port=0,
            num_receivers=SERVERS * TP, inference_dtype="bfloat16")
        self.thread, self.error = None, None

    def publish(self, version: int, state) -> None:
        def run():
            try:
                self.pub.publish(version, state)
            except BaseException as e:  # noqa: BLE001 - the test asserts on it
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and self.error is None, self.error


async def update(coord, trainer: Trainer, version: int) -> None:
    while coord.requested_version < version:  # the offer appears once the trainer reached publish
        await coord.maybe_update(None)
        await asyncio.sleep(0.01)
    await asyncio.to_thread(trainer.join)


async def scenario(tmp_path, fmt: str):
    paths = RunPaths(tmp_path)
    paths.root.mkdir(parents=True, exist_ok=True)
    weights = BroadcastWeightsConfig(bucket_size_mb=1, broadcast_timeout_s=60, sglang_format=fmt,
                                     verify_fraction=1.0, verify_rows=3)
    cfg = types.SimpleNamespace(weights=weights, inference=types.SimpleNamespace(
        num_workers=SERVERS, worker=types.SimpleNamespace(tp=TP)))
    s0, s1, s2 = model_state(0), model_state(1), model_state(2)
    async with serve_fake_sglang_weights(FakeWeightsConfig(tp_size=TP, state=bf16(s0))) as (u0, f0), \
            serve_fake_sglang_weights(FakeWeightsConfig(tp_size=TP, state=bf16(s0))) as (u1, f1):
        async with aiohttp.ClientSession() as session:
            clients = [InferenceClient(u, "tok", session=session, timeout_s=60) for u in (u0, u1)]
            coord = SGLangBroadcastCoordinator(cfg, paths, log=logging.getLogger("test"))
            trainer = Trainer(paths, weights)
            trainer.publish(0, s0)  # step 0 on disk, then the group forms
            await coord.start(clients)
            await asyncio.to_thread(trainer.join)

            trainer.publish(1, s1)
            await update(coord, trainer, 1)
            for fake in (f0, f1):
                for r in range(TP):
                    got = await asyncio.to_thread(fake.rank_state, r)
                    assert all(torch.equal(got[n], t) for n, t in bf16(s1).items()), (fake, r)
                assert fake.cfg.weight_version == "1"
            assert coord.version == 1 and coord.verified == 1 and coord.fallbacks == 0

            f1.corrupt_next("lm_head.weight")  # a server that loads wrong without saying so
            trainer.publish(2, s2)
            await update(coord, trainer, 2)
            assert coord.mismatched == 1 and coord.fallbacks == 1 and coord.version == 2
            assert latest_stable_step(paths.root / "weights") == 2  # the fallback wrote the step
            for fake in (f0, f1):
                for r in range(TP):
                    got = await asyncio.to_thread(fake.rank_state, r)
                    assert all(torch.equal(got[n], t) for n, t in bf16(s2).items()), (fake, r)
            trainer.pub.close()
        return f0.requests, f1.requests, coord


@pytest.mark.parametrize("fmt", ["flattened_bucket", "per_tensor"])
def test_two_servers_two_ranks_receive_bit_exact(tmp_path, fmt):
    reqs0, reqs1, coord = asyncio.run(asyncio.wait_for(scenario(tmp_path, fmt), 240))
    joins = [r["body"] for reqs in (reqs0, reqs1) for r in reqs if r["path"] == "/init_weights_update_group"]
    assert [j["rank_offset"] for j in joins] == [1, 1 + TP] and {j["world_size"] for j in joins} == {1 + SERVERS * TP}
    paths = [r["path"] for r in reqs0]
    first = paths.index("/pause_generation")
    n = len(coord.batches)
    assert n >= 2, "the 1 MiB buckets must cut this model into several calls"
    assert paths[first: first + 3 + n] == ["/pause_generation", "/begin_weight_update",
                                           *["/update_weights_from_distributed"] * n, "/end_weight_update"]
    assert "/continue_generation" in paths[first + 3 + n:]
    ups = [r["body"] for r in reqs0 if r["path"] == "/update_weights_from_distributed"][:n]
    assert [u["weight_version"] for u in ups] == [None] * (n - 1) + ["1"]
    assert [u["flush_cache"] for u in ups] == [False] * (n - 1) + [True]
    assert {u["load_format"] for u in ups} == ({"flattened_bucket"} if fmt == "flattened_bucket" else {None})
    disk = [r["body"] for r in reqs1 if r["path"] == "/update_weights_from_disk"]
    assert [(d["model_path"], d["weight_version"]) for d in disk] == [(str(RunPaths(tmp_path).weights(2)), "2")]


def _sharded_rank(rank: int, ports: tuple[int, int], out) -> None:
    """Trainer ranks 0, 1 hold a DTensor-sharded state; rank 2 receives as one SGLang server rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.fakes.fake_sglang_weights import receive_like_sglang
    from workers.weights.base import TensorMeta
    from workers.weights.sglang.broadcast_publisher import SGLangSender
    from workers.weights.sglang.wire import open_update_group, plan_batches
    from workers.weights.stream import DictStream

    torch.set_num_threads(1)
    full = model_state(3)
    metas = [TensorMeta(n, "bfloat16", tuple(t.shape), t.numel() * 2) for n, t in full.items()]
    batches = plan_batches(metas, 1 << 20)
    try:
        if rank < 2:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=2)
            mesh = init_device_mesh("cpu", (2,))
            state = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
            pg = open_update_group(backend="gloo", master_address="127.0.0.1", master_port=ports[1], world_size=2,
                                   rank=0, group_name="g", timeout_s=60) if rank == 0 else None
            SGLangSender(pg, batches, load_format="flattened_bucket", device=torch.device("cpu"),
                         timeout_s=60).send(DictStream(state), set(), 0)
            local = {n: t.to_local().shape[0] for n, t in state.items()}  # each rank held half the rows
            out.put((rank, all(local[n] < full[n].shape[0] for n in full if full[n].shape[0] > 1)))
            dist.destroy_process_group()
        else:
            pg = open_update_group(backend="gloo", master_address="127.0.0.1", master_port=ports[1], world_size=2,
                                   rank=1, group_name="g", timeout_s=60)
            got = {}
            for b in batches:
                body = b.body(group_name="g", load_format="flattened_bucket")
                got.update(receive_like_sglang(pg, body["names"], body["dtypes"], body["shapes"], "flattened_bucket"))
            out.put((rank, all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in full.items())))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(e).__name__}: {e}"))


def test_sharded_trainer_ranks_stream_into_one_server_rank():
    """Each tensor is gathered from two FSDP-style shards (DTensor.full_tensor) as its batch is sent:
    the server rank receives the whole model bit for bit."""
    import multiprocessing as mp

    from tests.helpers.netutil import free_port

    ctx = mp.get_context("spawn")
    out, ports = ctx.Queue(), (free_port(), free_port())
    procs = [ctx.Process(target=_sharded_rank, args=(r, ports, out), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {0: True, 1: True, 2: True}, results
