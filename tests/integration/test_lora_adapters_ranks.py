"""Several LoRA adapters (``trainer.lora.adapters``) in the real trainer (``python -m workers.trainer``) on
tiny_moe, 1 gloo rank vs 2 (FSDP2 on the CPU): each rank gets its share of the batch's rows with their
``adapter_ids``, every adapter's gradient is the sum over its rows wherever they landed, so the 2-rank run
publishes the 1-rank run's adapters (to float32 reduction order), one PEFT directory per adapter, and
the adapters differ (each trained on its own rows only).
"""
from __future__ import annotations

import numpy as np
import torch

from tests.integration.conftest import make_batch, publish_batch, start_rank, wait_all, write_ranks_run
from tests.helpers.netutil import free_port
from workers.common.protocol import RunPaths
from workers.weights.lora_format import read_adapter
from workers.weights.lora_steps import adapter_dirs

NAMES = ["short", "long"]
ROWS = np.array([0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1], np.int32)  # each row's adapter, uneven per rank's half


def _write(root, world: int, steps: int) -> RunPaths:
    from workers.common.config.lora import LoraConfig
    from workers.orchestrator.envs.mix import MixConfig

    env = MixConfig(weights={n: 1.0 for n in NAMES}, envs={n: {"name": "reverse_digits"} for n in NAMES})
    return write_ranks_run(root, num_steps=steps, num_ranks=world, env=env,
                           lora=LoraConfig(rank=4, alpha=8.0, targets=["attention"], adapters=list(NAMES)))


def _run(paths: RunPaths, world: int, steps: int) -> None:
    for s in range(1, steps + 1):
        tensors, meta = make_batch(s, rows=len(ROWS))
        publish_batch(paths, s, {**tensors, "adapter_ids": ROWS}, meta)
    port = free_port()
    wait_all([start_rank(paths, r, world, port) for r in range(world)], [paths], timeout_s=180)


def test_several_adapters_on_two_ranks_equal_one_rank(tmp_path):
    one, two = _write(tmp_path / "one", 1, 2), _write(tmp_path / "two", 2, 2)
    _run(one, 1, 2)
    _run(two, 2, 2)
    for step in (1, 2):
        assert sorted(adapter_dirs(one.weights(step))) == sorted(adapter_dirs(two.weights(step))) == sorted(NAMES)
    got = {}
    for name in NAMES:
        a1 = read_adapter(one.weights(2) / "adapters" / name)
        a2 = read_adapter(two.weights(2) / "adapters" / name)
        assert a1.tensors and set(a1.tensors) == set(a2.tensors)
        assert max(float(b.abs().max()) for _, b in a1.tensors.values()) > 0, name  # B moved off zero
        for t, (a, b) in a1.tensors.items():
            torch.testing.assert_close(a2.tensors[t][0], a, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(a2.tensors[t][1], b, rtol=1e-4, atol=1e-6)
        got[name] = a1
    t = next(iter(got["short"].tensors))  # each adapter learned from its own rows: not one update twice
    assert not torch.allclose(got["short"].tensors[t][1], got["long"].tensors[t][1], atol=1e-6)
