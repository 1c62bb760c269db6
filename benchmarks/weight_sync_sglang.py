"""The SGLang-protocol half of ``python -m benchmarks.weight_sync`` (broadcast into SGLang servers).

The same processes and the same state as the bucket-protocol measurement (benchmarks/weight_sync.py):
rank 0 runs our trainer-side sender (workers/weights/broadcast/sglang_publisher.SGLangSender, the
code the trainer runs) and the receivers run SGLang 0.5.23's receive path as the fake server's
ranks mirror it (tests/fakes/fake_sglang_weights.receive_like_sglang: per batch one flattened
uint8 bucket, or one broadcast per tensor), in a group made the way SGLang makes it
(sglang_wire.open_update_group). Same bytes: the tensors travel in their own dtypes.

Not timed (for either protocol): one HTTP call per batch (SGLang's /update_weights_from_distributed,
a few ms each) and loading into a model.
"""
from __future__ import annotations

import torch

from tests.fakes.fake_sglang_weights import receive_like_sglang
from workers.weights.base import TensorMeta
from workers.weights.broadcast.sglang_publisher import SGLangSender
from workers.weights.broadcast.sglang_wire import open_update_group, plan_batches

FORMAT = "flattened_bucket"


class SGLangBench:
    """One rank of the SGLang group: rank 0 sends, the others receive every batch."""

    def __init__(self, rank: int, world: int, port: int, shapes: list, bucket_mb: int, fmt: str = FORMAT):
        self.rank, self.fmt = rank, fmt
        metas = [TensorMeta(n, str(d).replace("torch.", ""), tuple(s),
                            torch.Size(s).numel() * torch.empty((), dtype=d).element_size()) for n, s, d in shapes]
        self.batches = plan_batches(metas, bucket_mb << 20)
        self.pg = open_update_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=world,
                                    rank=rank, group_name="bench_sglang", timeout_s=300)
        self.sender = SGLangSender(self.pg, self.batches, load_format=fmt, device=torch.device("cpu"),
                                   timeout_s=300) if rank == 0 else None

    def run(self, state) -> dict:
        """Rank 0: send ``state``; others: receive it (returned {name: tensor} for the exactness check)."""
        if self.rank == 0:
            self.sender.send(state, set(), 0)
            return {}
        got = {}
        for b in self.batches:
            body = b.body(group_name="bench_sglang", load_format=self.fmt)
            got.update(receive_like_sglang(self.pg, body["names"], body["dtypes"], body["shapes"], body["load_format"]))
        return got
