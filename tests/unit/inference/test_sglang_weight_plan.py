"""Pure pieces of the SGLang production path: batches, samples, rank offsets of multi-node servers,
the PD routing merge (workers/weights/sglang/wire.py, broadcast_coordinator.py,
workers/inference/sglang/pd_client.py)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import compose
from tests.unit.inference.sglang_cases import PRESETS
from workers.inference.sglang.pd_client import merge_routing, pick
from workers.weights.coordinator import receiver_rank_counts
from workers.weights.broadcast.join import join_weight_group
from workers.weights.sglang.wire import Batch, Wire, flat_offsets, plan_batches, sample_names


def w(name: str, dtype: str, nbytes: int) -> Wire:
    return Wire(name, dtype, (nbytes,), nbytes)


def test_batches_keep_order_one_dtype_and_the_size_limit():
    metas = [w("a", "bfloat16", 40), w("b", "bfloat16", 40), w("c", "bfloat16", 40), w("n", "float32", 8),
             w("d", "bfloat16", 200), w("e", "bfloat16", 10)]
    got = [[m.name for m in b.metas] for b in plan_batches(metas, 100)]
    assert got == [["a", "b"], ["c"], ["n"], ["d"], ["e"]]  # a bigger tensor goes alone
    assert [b.index for b in plan_batches(metas, 100)] == list(range(5))
    body = plan_batches(metas, 100)[0].body(group_name="g", load_format="per_tensor")
    assert body == {"names": ["a", "b"], "dtypes": ["bfloat16"] * 2, "shapes": [[40], [40]], "group_name": "g",
                    "load_format": None}


def test_flattened_offsets_refuse_misalignment():
    assert flat_offsets(Batch(0, (w("a", "bfloat16", 6), w("b", "bfloat16", 4)))) == [0, 6]
    with pytest.raises(ValueError, match="unaligned tensor b"):
        flat_offsets(Batch(0, (w("a", "bfloat16", 6), Wire("b", "float32", (1,), 4))))


def test_samples_are_a_fraction_drawn_anew_each_version():
    names = [f"t{i}" for i in range(100)]
    assert sample_names(names, 0.0, 3) == [] and len(sample_names(names, 0.05, 3)) == 5
    assert sample_names(names, 0.05, 3) == sample_names(names, 0.05, 3) != sample_names(names, 0.05, 4)
    assert len(sample_names(names, 0.001, 1)) == 1 and sample_names(names, 1.0, 1) == sorted(names)


def test_multi_node_servers_join_at_their_rank_offsets():
    """GLM-5: 2 prefill servers of tp16 (2 nodes each), 2 decode of tp32 (4 nodes): every GPU a rank."""
    cfg = compose(PRESETS["glm5_swe_28xh200"])
    counts = receiver_rank_counts(cfg)
    assert counts == [16, 16, 32, 32]

    class Client:
        base_url = "http://x"

        async def init_weights_update_group(self, **kw):
            self.kw = kw
            return {"success": True}
    clients = [Client() for _ in counts]
    group = {"master_address": "t0", "master_port": 1, "world_size": 97, "group_name": "g", "backend": "nccl"}
    offsets = asyncio.run(join_weight_group(clients, group, counts, timeout_s=1))
    assert offsets == [1, 17, 33, 65] and [c.kw["rank_offset"] for c in clients] == offsets
    with pytest.raises(RuntimeError, match="world_size"):
        asyncio.run(join_weight_group(clients, dict(group, world_size=96), counts, timeout_s=1))


def test_routing_merge_per_position():
    pre, dec = np.zeros((5, 2, 2), np.uint8), np.ones((3, 2, 2), np.uint8)
    got = merge_routing(pre, dec, prompt_len=5, num_output=4)
    assert got.shape == (8, 2, 2) and (got[:5] == 0).all() and (got[5:] == 1).all()
    assert merge_routing(pre[:4], dec, prompt_len=5, num_output=4) is None  # prefill short: mark the sample
    assert merge_routing(pre, None, prompt_len=5, num_output=4) is None
    assert {pick(f"k{i}", 3, "prefill") for i in range(50)} == {0, 1, 2} and pick("k", 3, "p") == pick("k", 3, "p")


def test_the_broadcast_transport_speaks_sglang_to_sglang_servers(tmp_path):
    import logging
    import types

    from workers.common.protocol import RunPaths
    from workers.common.registry import TRANSPORTS
    from workers.weights.broadcast.coordinator import BroadcastCoordinator
    from workers.weights.sglang.broadcast_coordinator import SGLangBroadcastCoordinator
    from workers.weights.sglang.broadcast_publisher import SGLangBroadcastPublisher

    spec, paths = TRANSPORTS.get("broadcast"), RunPaths(tmp_path)
    sglang = compose(PRESETS["glm5_swe_28xh200"])
    assert sglang.weights.transport == "broadcast"
    assert isinstance(spec.coordinator(sglang, paths, log=logging.getLogger("t")), SGLangBroadcastCoordinator)
    embedded = compose(["weights=broadcast"])
    coord = spec.coordinator(embedded, paths, log=logging.getLogger("t"))
    assert isinstance(coord, BroadcastCoordinator) and not isinstance(coord, SGLangBroadcastCoordinator)
    topo = types.SimpleNamespace(master_addr="127.0.0.1", weights_group_addr="")
    pub = spec.publisher(sglang, paths, topo, rank=0, world_size=1)
    assert isinstance(pub, SGLangBroadcastPublisher) and pub.num_receivers == 96
    assert pub.inference_dtype == "bfloat16"
    pub.close()
