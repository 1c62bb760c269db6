"""The broadcast transport through the real HTTP path: two embedded inference servers
(``python -m workers.inference`` subprocesses) join the weight group on
/init_weights_update_group and receive on /update_weights_from_distributed, driven by the
orchestrator's own functions (rollouts.py); this process plays trainer rank 0 with the
real BroadcastPublisher. Checks: a good update leaves both workers bit-identical to the
trainer (the digests they report), a corrupt bucket and a shape mismatch are refused
while the workers keep serving the version they had, and a group can be left and re-joined.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import pytest
import torch
from omegaconf import OmegaConf

from workers.common.config import ClusterConfig, RunConfig
from workers.common.inference_client import InferenceClient, wait_until_ready
from workers.common.protocol import RunPaths, wait_for
from workers.inference.embedded.config import EmbeddedInferenceConfig
from workers.models.tiny_moe.model import TinyMoeConfig, build_model
from workers.orchestrator.envs.reverse_digits import ReverseDigitsConfig
from workers.weights.broadcast import BroadcastWeightsConfig
from workers.weights.broadcast.coordinator import update_all_workers_distributed
from workers.weights.broadcast.join import join_weight_group
from workers.weights.coordinator import WeightUpdateError
from workers.weights.base import SoloPeers
from workers.weights.broadcast.publisher import BroadcastPublisher, BucketSender
from workers.weights.checksums import state_digest, state_hashes
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.broadcast.handshake import Handshake
from tests.helpers.netutil import free_port

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-admin-token"
MODEL = dict(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
             expert_intermediate_size=32, max_position_embeddings=64)
WEIGHTS = BroadcastWeightsConfig(bucket_size_mb=1, lone_tensor_mb=1, broadcast_timeout_s=30, verify=True)


def start_servers(paths: RunPaths, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    cfg = RunConfig(cluster=ClusterConfig(name="local"), env=ReverseDigitsConfig(),
                    model=TinyMoeConfig(name="tiny_moe", init_seed=5, **MODEL), weights=WEIGHTS,
                    inference=EmbeddedInferenceConfig(num_workers=n, max_batch_size=8, startup_timeout_s=60))
    paths.run_config.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    paths.admin_token.write_text(TOKEN)
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(n)]
    procs = []
    for rank in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD_SIZE"))}
        env.update(SLURMRL_ROLE="inference", SLURMRL_RUN_DIR=str(paths.root), SLURMRL_LOCAL="1", RANK=str(rank),
                   SLURMRL_INFERENCE_URLS=",".join(urls), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        log = open(paths.logs_dir / f"inference_{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.inference"], cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs, urls


class Trainer:
    """Trainer rank 0 of one weight group, publishing in a thread like the real loop does."""

    def __init__(self, paths: RunPaths, num_receivers: int):
        self.pub = BroadcastPublisher(paths, WEIGHTS, SoloPeers(), initial=FilesystemPublisher(
            paths.root / "weights", peers=SoloPeers(), keep_last=3), host="127.0.0.1", port=0,
            num_receivers=num_receivers)
        self.thread, self.error = None, None

    def publish(self, version: int, state) -> None:
        def run():
            try:
                self.pub.publish(version, state)
            except BaseException as e:
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error


@pytest.fixture()
def servers(tmp_path):
    paths = RunPaths(tmp_path).ensure()
    procs, urls = start_servers(paths, 2)
    yield paths, urls
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_broadcast_updates_over_http_are_exact_and_bad_ones_are_refused(servers):
    paths, urls = servers
    handshake = Handshake(paths.root)
    state = build_model(TinyMoeConfig(**MODEL), seed=5).state_dict()
    trainer = Trainer(paths, num_receivers=2)
    trainer.publish(0, state)  # step 0 to disk (the workers boot from it), then it waits for the group

    async def body(session):
        clients = [InferenceClient(u, TOKEN, session=session, timeout_s=60) for u in urls]
        await wait_until_ready(clients, deadline_s=90)
        group = await asyncio.to_thread(wait_for, handshake.read_group, timeout_s=30, what="group.json", peer="trainer")
        await join_weight_group(clients, group, [1, 1], timeout_s=30)
        await asyncio.to_thread(trainer.join)

        async def update(version, new, tr=trainer, grp=group):
            tr.publish(version, new)
            while (handshake.offered() or {}).get("version") != version:
                await asyncio.sleep(0.005)
            try:
                return await update_all_workers_distributed(clients, grp, version, timeout_s=30,
                                                            request=lambda: handshake.request(version))
            finally:
                await asyncio.to_thread(tr.join)  # senders finish even when workers refuse

        v1 = {k: v + 0.5 for k, v in state.items()}
        swap = await update(1, v1)
        assert swap.digests == [state_digest(state_hashes(v1))] * 2  # bit-identical on both workers
        assert [(await c.get_model_info())["weight_version"] for c in clients] == ["1", "1"]

        good = trainer.pub.sender
        trainer.pub.sender = CorruptingSender(trainer.pub.group)
        with pytest.raises(WeightUpdateError, match="fails its checksum"):
            await update(2, {k: v + 1.0 for k, v in state.items()})
        trainer.pub.sender = good
        for c in clients:
            assert (await c.get_model_info())["weight_version"] == "1"
            await c.health_generate()  # still serving v1
        out = await clients[0].generate([1, 2, 3], temperature=0.0, max_new_tokens=4)
        assert out.token_versions == [1] * 4

        # A trainer whose lm_head has one row too many: received, then refused by shape.
        for c in clients:
            await c.destroy_weights_update_group(group["group_name"])
        wrong = dict(v1, **{"lm_head.weight": torch.zeros(MODEL["vocab_size"] + 1, MODEL["hidden_size"])})
        other = Trainer(paths, num_receivers=2)
        other.pub.initial = _NoDisk()
        other.publish(0, wrong)
        group2 = await asyncio.to_thread(wait_for, lambda: (g := handshake.read_group()) and g["master_port"] != group[
            "master_port"] and g, timeout_s=30, what="the second group.json", peer="trainer")
        await join_weight_group(clients, group2, [1, 1], timeout_s=30)
        await asyncio.to_thread(other.join)
        with pytest.raises(WeightUpdateError, match="published shape"):
            await update(3, wrong, tr=other, grp=group2)
        assert [(await c.get_model_info())["weight_version"] for c in clients] == ["1", "1"]
        other.pub.close()

    async def main():
        async with aiohttp.ClientSession() as session:
            await body(session)
    asyncio.run(main())
    trainer.pub.close()
    log = (paths.logs_dir / "inference_0.log").read_text()
    assert "joined weight group" in log and "refused broadcast v2" in log and "Traceback" not in log


class CorruptingSender(BucketSender):
    """Announces checksums the data does not have (a flipped bit in transit)."""

    def _pack(self, bucket, state, slot):
        buf, checksum = super()._pack(bucket, state, slot)
        return buf, f"{(int(checksum, 16) ^ 1):016x}"


class _NoDisk:
    """The second trainer must not overwrite step 0 on disk: its weights do not fit the model."""

    def publish(self, version, state):
        from workers.weights.base import SyncStats
        return SyncStats(bytes=0, seconds=0.0)

    def close(self):
        pass
