"""benchmarks/gpu/one_gpu_node.py on the CPU (``--cpu-smoke``): the quickstart's own script, a
transformers-built Qwen3-MoE checkpoint through ``experiment=one_gpu_node model.path=DIR`` for two
steps, so the command the GPU machine runs is known to work before GPU time is spent."""
from __future__ import annotations

import json

import pytest

from benchmarks.gpu import one_gpu_node


@pytest.mark.slow
def test_cpu_smoke_runs_the_preset_end_to_end(tmp_path):
    assert one_gpu_node.main(["--out", str(tmp_path), "--cpu-smoke"]) == 0
    res = json.loads((tmp_path / "one_gpu_node.json").read_text())
    assert res["returncode"] == 0 and res["steps"] == 2 and not res["problems"]
    assert "experiment=one_gpu_node model.path=" in res["command"]
    assert any("every role on the CPU" in line for line in res["plan"])
    assert (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "checkpoint").exists()
