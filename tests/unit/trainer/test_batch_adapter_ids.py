"""The batch loader's ``adapter_ids`` (several LoRA adapters, workers/trainer/batch.py): a row without its
adapter, or naming one the run does not train, would train the wrong adapter silently; each such batch is
refused naming ``trainer.lora.adapters``, and a good one arrives as int64 [B] that follows row selection."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from tests.helpers.trainer_ranks import RANKS_MODEL, make_batch
from workers.trainer.batch import BatchFormatError, load_batch

ADAPTERS = ("short", "long")
MODEL = dict(num_layers=RANKS_MODEL["num_layers"], top_k=RANKS_MODEL["top_k"], num_experts=RANKS_MODEL["num_experts"])


def write(tmp_path, ids=None):
    tensors, meta = make_batch(1, rows=6)
    if ids is not None:
        tensors["adapter_ids"] = ids
    save_file(tensors, str(tmp_path / "batch.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return tmp_path


def test_adapter_ids_are_loaded_per_row(tmp_path):
    ids = np.array([0, 1, 1, 0, 0, 1], np.int32)
    batch = load_batch(write(tmp_path, ids), step=1, adapters=ADAPTERS, **MODEL)
    assert batch.adapter_ids.dtype == torch.int64 and batch.adapter_ids.tolist() == ids.tolist()
    assert batch.rows(torch.tensor([1, 3])).adapter_ids.tolist() == [1, 0]  # micro-batches keep each row's adapter
    assert load_batch(write(tmp_path), step=1, **MODEL).adapter_ids is None  # one adapter: none needed


@pytest.mark.parametrize("ids, adapters, match", [
    (None, ADAPTERS, r"adapter_ids absent but the run trains trainer.lora.adapters=\['short', 'long'\]"),
    (np.array([0, 1, 2, 0, 0, 1], np.int32), ADAPTERS, r"adapter_ids \[0, 1, 2\] .* index 0..1"),
    (np.array([0, -1, 1, 0, 0, 1], np.int32), ADAPTERS, r"adapter_ids \[-1, 0, 1\]"),
    (np.array([0, 1, 1, 0, 0, 1], np.int32), (), r"trainer.lora.adapters=\[\].*a run of one adapter has no adapter_ids"),
    (np.array([0, 1, 1, 0, 0, 1], np.int64), ADAPTERS, r"adapter_ids is int64\[6\], expected int32"),
    (np.array([0, 1, 1, 0], np.int32), ADAPTERS, r"adapter_ids has shape \(4,\), expected leading \(6,\)"),
])
def test_bad_adapter_ids_are_refused(tmp_path, ids, adapters, match):
    with pytest.raises(BatchFormatError, match=match):
        load_batch(write(tmp_path, ids), step=1, adapters=adapters, **MODEL)
