"""Publishing without the full model on any rank, and the FSDP plan's meta-device init (issue 19, item 4).

At world 2 (gloo, forked ranks) under the FSDP plan: the step-0 model built on the meta device and
filled shard by shard equals :func:`initial_model` bit for bit; publishing through
``ModelWeights`` (workers/trainer/weight_stream.py) writes the very bytes that publishing the full
state dict writes; and while it publishes, the gathered tensors a rank holds at once (counted by
weakref finalizers on what the stream yields) never exceed two tensors, while the old path (the
full state dict, then publish) holds the whole model. (torch.profiler's CPU memory counter was
tried for this: frees on gloo's threads are not counted there, so it drifts upward.) Under the
mesh plan with ep = 2 (experts live on one EP rank each) the stream yields what ``full_state_dict``
gathers, in the same order, on every rank (and with tp = 2, TP-sharded DTensors). Delta steps
(weights.delta) write the same files both ways.
"""
from __future__ import annotations

import filecmp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import compose
from tests.helpers.held_stream import Held
from tests.helpers.netutil import gloo_dims, run_ranks
from workers.common.protocol import step_name
from workers.trainer.loop import initial_model, step0_model
from workers.trainer import weight_stream
from workers.trainer.weight_stream import ModelWeights
from workers.weights.base import DistPeers
from workers.weights.filesystem.publisher import FilesystemPublisher
from workers.common.dtensor import full_tensor

TINY = ["model=tiny_moe", "model.hidden_size=64", "model.num_layers=3", "model.expert_intermediate_size=32",
        "model.num_experts=16", "trainer.num_ranks=2", "trainer.dtype=bfloat16"]


def _fsdp_rank(rank: int, world: int, port: int, cfg, root: str) -> None:
    dims = gloo_dims(rank, world, port)
    try:
        model = step0_model(cfg, dims)  # meta device + per-rank fill (FSDP plan)
        ref = initial_model(cfg).state_dict()  # today's path: the full model on the CPU
        full = model.full_state_dict(to_rank=None)
        assert list(full) == list(ref)
        for name, t in ref.items():
            assert torch.equal(full[name], t) and full[name].dtype == t.dtype, name
        del full, ref
        compute = torch.bfloat16
        pubs = [FilesystemPublisher(Path(root) / kind, peers=DistPeers(), keep_last=3) for kind in ("stream", "dict")]
        streamed = Held(ModelWeights(model, dtype=compute))
        pubs[0].publish(1, streamed)
        whole = Held(ModelWeights(model, dtype=compute))
        pubs[1].publish(1, dict(whole.items()))  # today's path: the full state dict, then publish
        for p in pubs:
            p.close()
        largest, total = max(m.nbytes for m in streamed.metas), streamed.nbytes
        assert whole.peak == total, (whole.peak, total)
        assert streamed.peak <= 2 * largest, (streamed.peak, largest, total)  # the one being written + the next
        assert streamed.live == 0, "the publisher keeps no gathered tensor"
        torch.save({"streamed": streamed.peak, "whole": whole.peak, "largest": largest, "total": total},
                   Path(root) / f"peaks{rank}.pt")
        # delta mode: step 2 rewrites only the tensor that changed (hashing pass, then a pass over it)
        deltas = [FilesystemPublisher(Path(root) / f"delta_{kind}", peers=DistPeers(), keep_last=3, delta=True)
                  for kind in ("stream", "dict")]
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    next(model.parameters()).to_local().add_(1.0)  # every rank changes its shard of one tensor
            moved = deltas[0].publish(version, Held(ModelWeights(model, dtype=compute))).bytes
            deltas[1].publish(version, model.full_state_dict(to_rank=None, dtype=compute))
        assert moved == max(m.nbytes for m in streamed.metas if m.name == next(iter(model.state_dict()))), moved
        for p in deltas:
            p.close()
    finally:
        dist.destroy_process_group()


def test_fsdp_meta_init_and_streamed_publish_bounded(tmp_path):
    cfg = compose(TINY)
    run_ranks(_fsdp_rank, 2, (cfg, str(tmp_path)), what="streamed publish at world 2 (FSDP plan)")
    a, b = tmp_path / "stream" / step_name(1), tmp_path / "dict" / step_name(1)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) >= 4  # 2 shards, index.json, STABLE
    for name in files:
        if name != "STABLE":  # STABLE holds the publish time
            assert filecmp.cmp(a / name, b / name, shallow=False), f"{name} differs between stream and dict publish"
    a, b = tmp_path / "delta_stream" / step_name(2), tmp_path / "delta_dict" / step_name(2)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all(filecmp.cmp(a / n, b / n, shallow=False) for n in files if n != "STABLE"), "delta steps differ"
    peaks = torch.load(tmp_path / "peaks0.pt")
    assert peaks["streamed"] * 10 < peaks["total"], peaks
    print(f"rank 0: gathered bytes held at once: streamed {peaks['streamed']} B, full dict {peaks['whole']} B "
          f"(largest tensor {peaks['largest']} B, model {peaks['total']} B, bf16)")


def _mesh_rank(rank: int, world: int, port: int, cfg, tp: int, ep: int) -> None:
    dims = gloo_dims(rank, world, port, tp=tp, ep=ep)
    try:
        model = step0_model(cfg, dims)
        full = model.full_state_dict(to_rank=None, dtype=torch.bfloat16)
        stream = ModelWeights(model, dtype=torch.bfloat16)
        assert stream.names == list(full), "the stream keeps full_state_dict's names and order"
        remote = [n for n in stream.names if ".experts." in n and n not in model.state_dict()]
        assert bool(remote) == (ep > 1), "ep = 2: half the experts live on the other EP rank"
        gathers = []
        weight_stream.full_tensor = lambda t: gathers.append(1) or full_tensor(t)
        try:
            for (name, t), m in zip(stream.items(), stream.metas):
                assert torch.equal(t, full[name]) and t.dtype == full[name].dtype, name
                assert (m.dtype, m.shape, m.nbytes) == ("bfloat16", tuple(t.shape), t.numel() * 2), name
        finally:
            weight_stream.full_tensor = full_tensor
        mine = {(slot.prefix, slot.stack) for slot in stream.slots.values() if slot.owner == dims.ep_rank}
        dense = [n for n in stream.names if n not in stream.slots]
        assert mine and len(gathers) == len(dense) + len(mine), "each expert stack is gathered once"
        sub = [n for n in reversed(stream.names) if ".experts." in n][:5]  # any order, as broadcast buckets ask
        assert all(torch.equal(t, full[n]) for n, t in stream.items(sub))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_mesh_plan_stream_equals_full_state_dict(tp, ep):
    cfg = compose([*TINY, f"trainer.parallel.tp={tp}", f"trainer.parallel.ep={ep}"])
    run_ranks(_mesh_rank, 2, (cfg, tp, ep), what=f"weight stream at world 2, tp {tp} ep {ep} (mesh plan)")
