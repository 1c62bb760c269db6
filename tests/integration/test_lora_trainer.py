"""The real trainer (``python -m workers.trainer``) with ``trainer.lora`` on tiny_moe (attention and
per-expert adapters, Router Replay on), 1 gloo rank vs 2 (FSDP2 shards the adapters with their base):

- weights/step_0 is the full base; every later step is a PEFT adapter dir (workers/weights/lora_format.py);
- the 2-rank run publishes the 1-rank run's adapters (to float32 reduction order);
- the adapters moved (B left zero), the checkpoint holds adapters and their AdamW state only (no base
  tensor, no state for one), and a trainer resumed from step 1's checkpoint redoes step 2 exactly.
"""
from __future__ import annotations

import shutil

import torch
import torch.distributed.checkpoint as dcp

from tests.integration.conftest import make_batch, publish_batch, start_rank, wait_all, write_ranks_run
from tests.helpers.netutil import free_port
from workers.common.protocol import RunPaths
from workers.weights.lora_format import is_adapter_dir, read_adapter

LORA = {"rank": 4, "alpha": 8.0, "targets": ["attention", "experts"]}


def _run(paths: RunPaths, world: int, steps: int) -> None:
    for s in range(1, steps + 1):
        publish_batch(paths, s, *make_batch(s))
    port = free_port()
    wait_all([start_rank(paths, r, world, port) for r in range(world)], [paths], timeout_s=120)


def _write(root, world: int, steps: int) -> RunPaths:
    from workers.common.config.lora import LoraConfig

    return write_ranks_run(root, num_steps=steps, num_ranks=world, lora=LoraConfig(**LORA), checkpoint_every_steps=1,
                           num_checkpoints_kept=3)


def test_lora_trainer_publishes_adapters_shards_checkpoints_and_resumes(tmp_path):
    one, two = _write(tmp_path / "one", 1, 2), _write(tmp_path / "two", 2, 2)
    _run(one, 1, 2)
    _run(two, 2, 2)
    assert not is_adapter_dir(one.weights(0)) and any(one.weights(0).glob("*.safetensors"))  # the base
    a1, a2 = read_adapter(one.weights(2)), read_adapter(two.weights(2))
    assert is_adapter_dir(one.weights(1)) and a1.rank == 4 and a1.base_model == str(one.weights(0))
    assert any(".experts." in t for t in a1.tensors) and any("q_proj" in t for t in a1.tensors)
    assert not any(".gate" in t.rpartition(".")[2] for t in a1.tensors if "experts" not in t)  # no router
    assert max(float(b.abs().max()) for _, b in a1.tensors.values()) > 0  # B moved off zero
    for t, (a, b) in a1.tensors.items():
        torch.testing.assert_close(a2.tensors[t][0], a, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a2.tensors[t][1], b, rtol=1e-4, atol=1e-6)
    ckpt = one.root / "checkpoints" / "step_000002"
    keys = list(dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert optim_keys and all("lora_" in k for k in optim_keys), optim_keys
    # resume: drop checkpoint 2 and weights 2; the trainer restarts from checkpoint 1 and redoes step 2
    shutil.rmtree(ckpt)
    shutil.rmtree(one.weights(2))
    port = free_port()
    wait_all([start_rank(one, 0, 1, port)], [one], timeout_s=120)
    again = read_adapter(one.weights(2))
    for t, (a, b) in a1.tensors.items():
        assert torch.equal(again.tensors[t][0], a) and torch.equal(again.tensors[t][1], b), t
