"""GLM-5's DSA layer benchmark (benchmarks/gpu/bench_dsa_layer.py): its FLOP count (the sparse
pairs against a brute-force count, the indexer's quadratic scoring apart), the card peaks, and the
CPU smoke through the same code the GPU runs, the fused rows under Triton's interpreter, feeding
benchmarks/gpu/one_gpu_node_limit.py's ``dsa_glm5_rows``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.bench_dsa_layer import GLM5, flops, sparse_pairs
from benchmarks.gpu.common import peak_flops

REPO = Path(__file__).resolve().parents[3]


def test_sparse_pairs_count_each_query_min_k_and_its_visible_keys():
    for t, k in ((1, 4), (5, 8), (9, 4), (40, 7)):
        assert sparse_pairs(t, k) == sum(min(k, i + 1) for i in range(t))


def test_glm5_flops_by_part():
    f = flops(GLM5, 131072)
    assert f["sparse_attention"] == 3 * 2 * 64 * (576 + 512) * sparse_pairs(131072, 2048)
    assert f["indexer_scoring"] == 2 * 32 * 128 * 131072 * 131073 / 2  # dense causal, forward only
    assert 0.15 < f["indexer_scoring"] / f["total"] < 0.3  # quadratic: 22 % of the layer at 131k, 7 % at 32k
    assert flops(GLM5, 32768)["indexer_scoring"] / flops(GLM5, 32768)["total"] < 0.1
    assert abs(flops(GLM5, 32768)["sparse_attention"] * 4 / f["sparse_attention"] - 1) < 0.03  # linear in T (the first K rows see fewer)
    assert f["total"] == sum(v for k, v in f.items() if k != "total")


def test_peaks_by_card_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == (989e12, 67e12)
    assert peak_flops("NVIDIA H100 PCIe")[0] == 756e12 and peak_flops("NVIDIA H200")[0] == 989e12
    assert peak_flops("cpu (x86_64)") == (None, None)


def test_smoke_through_one_gpu_node_limit_writes_the_dsa_rows(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TRITON_INTERPRET="1")
    out, earlier = tmp_path / "out", tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"engine_decode_step_ms": 2.0, "parts": {"engine": {"returncode": 0}}}))
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu.one_gpu_node_limit", "--cpu-smoke", "--out", str(out),
                        "--work", str(tmp_path / "work"), "--parts", "dsa", "--merge-from", str(earlier)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "one_gpu_node_limit.json").read_text())
    assert res["engine_decode_step_ms"] == 2.0 and set(res["parts"]) == {"engine", "dsa"}  # merged, kept
    rows = {r["path"]: r for r in res["dsa_glm5_rows"]}
    assert set(rows) == {"torch", "fused"} and "dsa_glm5_rows_reason" not in res
    for r in rows.values():
        assert r["seq_len"] == 24 and "error" not in r, r
        assert r["layer_s_median"] > 0 and r["attention_s_median"] > 0 and r["tflops"]["attention"] > 0
    assert res["dsa_glm5_setup"]["config"]["index_topk"] == 16
    assert "torch" in (out / "dsa.log").read_text() and "fused" in p.stdout
