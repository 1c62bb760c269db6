"""Sparse patches from sharded trainers (weights.delta, issue 31): FSDP and the mesh plan at world 2.

Each rank diffs only its own shards (no gather); replicas are sent once; expert stacks are split into
per-expert HF tensors. After every version a receiver that steps along, and a fresh one replaying
anchor + patches, hold exactly what a dense publish (``full_state_dict`` in bf16) would give.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import compose
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.common.protocol import step_name
from workers.trainer.loop import step0_model
from workers.trainer.weight_stream import ModelWeights
from workers.weights.base import DistPeers
from workers.weights.checksums import state_hashes
from workers.weights.delta.apply import apply_chain
from workers.weights.filesystem.patch_publisher import PatchPublisher
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.weights.filesystem.receiver import DiskReader
from workers.common.dtensor import local_part

TINY = ["model=tiny_moe", "model.hidden_size=64", "model.num_layers=2", "model.expert_intermediate_size=32",
        "model.num_experts=8", "trainer.num_ranks=2", "trainer.dtype=bfloat16"]


def _nudge(model, version: int) -> None:
    """An optimizer-like step: every shard moves a little (replicas alike: seeded by name)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = local_part(p)
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + version)
            local.add_(torch.randn(local.shape, generator=g) * 2e-3)


def _load(reader, params, sums, step_dir):
    got = reader.load(step_dir, None, None, sums)
    if got.patches:
        sums = apply_chain(params, got.patches, got.sums)
    else:
        params.update({n: t.clone() for n, t in got.state.items()})
        sums = got.sums
    return params, sums, got


def _rank(rank: int, world: int, port: int, cfg, tp: int, ep: int, root: str) -> None:
    dims = gloo_dims(rank, world, port, tp=tp, ep=ep)
    try:
        model = step0_model(cfg, dims)
        pub = PatchPublisher(FilesystemPublisher(Path(root), peers=DistPeers(), keep_last=10), full_every=3)
        params, sums, reader = {}, None, DiskReader()
        fractions = []
        for v in range(6):
            if v:
                _nudge(model, v)
            stats = pub.publish(v, ModelWeights(model, dtype=torch.bfloat16)).metrics()
            pub.flush()
            fractions.append(stats["weight_changed_frac"])
            dense = model.full_state_dict(to_rank=None, dtype=torch.bfloat16)  # what a dense publish sends
            dist.barrier()
            if rank == 0:
                params, sums, got = _load(reader, params, sums, Path(root) / step_name(v))
                assert bool(got.patches) == (v % 3 != 0), v
                assert state_hashes(params) == state_hashes(dense), f"steady receiver differs at v{v}"
                fresh, _, _ = _load(DiskReader(), {}, None, Path(root) / step_name(v))
                assert state_hashes(fresh) == state_hashes(dense), f"fresh receiver differs at v{v}"
        pub.close()
        assert all(0 < f < 1 for i, f in enumerate(fractions) if i % 3), fractions
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 1)])
def test_sharded_patches_equal_a_dense_publish(tmp_path, tp, ep):
    cfg = compose([*TINY, f"trainer.parallel.tp={tp}", f"trainer.parallel.ep={ep}"])
    run_ranks(_rank, 2, (cfg, tp, ep, str(tmp_path)), what=f"patch publish at world 2, tp {tp} ep {ep}")
    parts = {p.name for p in (tmp_path / step_name(1)).iterdir()}
    assert {"index.json", "STABLE"} <= parts and any(n.startswith("patch-") for n in parts)
