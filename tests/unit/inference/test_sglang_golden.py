"""Golden sbatch scripts of the SGLang presets, and the Slurm guide's feature table.

The GLM-5 script is golden in test_render_golden.py; the Kimi-K2 and Nemotron-3-Ultra ones
are here, rendered the same way. The section "SGLang features per preset" of
docs/guide/slurm_cluster.md is
generated from the plans (JobPlan.backend_steps), so it cannot drift from what the scripts run.
Refresh both after an intended change with
    SLURMRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/inference/test_sglang_golden.py
and review the diff like code.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launcher.plan import build_plan
from tests.conftest import compose
from tests.unit.conftest import GOLDEN, render

REPO = Path(__file__).resolve().parents[3]
CASES = {"kimi_k2_swe_32xh200_h200_ib.sbatch": ["experiment=kimi_k2_swe_32xh200"],
         "nemotron3_ultra_pd_20xh200_h200_ib.sbatch": ["experiment=nemotron3_ultra_pd_20xh200"]}
TABLE_PRESETS = {"glm5_swe_28xh200": ["experiment=glm5_swe_28xh200", "cluster=h200_ib"],
                 "kimi_k2_swe_32xh200": ["experiment=kimi_k2_swe_32xh200"],
                 "nemotron3_ultra_pd_20xh200": ["experiment=nemotron3_ultra_pd_20xh200"]}
BEGIN, END = "<!-- sglang-features:begin -->", "<!-- sglang-features:end -->"
REFRESH = f"SLURMRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest {Path(__file__).relative_to(REPO)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name, tmp_path):
    text = render(CASES[name])
    path = GOLDEN / name
    if os.environ.get("SLURMRL_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} is missing: create it with {REFRESH}"
    assert text == path.read_text(), f"rendered script differs from {path}; if intended, refresh with {REFRESH}"
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def matrix_row(name: str, cfg) -> str:
    """One preset's row: which features any of its roles turns on (yes / no, with the detail)."""
    i = cfg.inference
    roles = [(i.prefill, "prefill"), (i.decode, "decode")] if i.num_prefill_replicas else [(i.worker, "unified")]
    deepep = [f"{n} {lay.sglang.deepep_mode}" for lay, n in roles if lay.sglang.moe_a2a_backend == "deepep"]
    eplb = [n for lay, n in roles if lay.sglang.enable_eplb]
    hicache = [n + (f" + {lay.sglang.hicache_storage_backend}" if lay.sglang.hicache_storage_backend else "")
               for lay, n in roles if lay.sglang.enable_hierarchical_cache]
    s = i.sglang
    fp8 = "deep_gemm" in (s.fp8_gemm_backend, s.moe_runner_backend) or s.quantization is not None
    cells = [
        "yes" if i.num_prefill_replicas else "no",
        ", ".join(f"{n} x{lay.num_nodes_per_replica}" for lay, n in roles if lay.num_nodes_per_replica > 1) or "no",
        ", ".join(f"{n} ep{lay.ep}" for lay, n in roles if lay.ep > 1) or "no",
        ", ".join(deepep) or "no",
        ", ".join(f"{n} {lay.dp_attention}" for lay, n in roles if lay.dp_attention > 1) or "no",
        ", ".join(eplb) or "no",
        "checkpoint FP8 + DeepGEMM" if fp8 else "no (bf16)",
        s.kv_cache_dtype if s.kv_cache_dtype != "auto" else "no",
        ", ".join(hicache) or "no",
        "yes" if cfg.orchestrator.return_routed_experts else "no (PD router)",
        s.router.prefill_policy if i.num_prefill_replicas else s.router.policy,
    ]
    return f"| `{name}` | " + " | ".join(cells) + " |"


def feature_table() -> str:
    head = ["| preset | PD disaggregation | multi-node replicas | expert parallel | DeepEP | DP attention | EPLB "
            "| FP8 weights | FP8 KV cache | HiCache | routed experts (R3) | router policy |",
            "|" + "---|" * 12]
    rows = [matrix_row(name, compose(ov)) for name, ov in TABLE_PRESETS.items()]
    detail = ["", "Per role, as the plan summary prints it:", "", "| preset | role | SGLang / smg features |",
              "|---|---|---|"]
    for name, overrides in TABLE_PRESETS.items():
        for step in build_plan(compose(overrides)).backend_steps:
            detail.append(f"| `{name}` | {step.role} | {', '.join(step.features)} |")
    return "\n".join(head + rows + detail)


def test_guide_feature_table_is_generated_from_the_plans():
    readme = REPO / "docs" / "guide" / "slurm_cluster.md"
    text = readme.read_text()
    assert BEGIN in text and END in text, f"{readme} lacks the {BEGIN} ... {END} section"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    want = f"{head}{BEGIN}\n{feature_table()}\n{END}{tail}"
    if os.environ.get("SLURMRL_UPDATE_GOLDEN") == "1":
        readme.write_text(want)
        text = want
    assert text == want, f"{readme}'s SGLang feature table is stale; refresh with {REFRESH}"


def test_scripts_show_the_exact_sglang_and_router_commands():
    text = (GOLDEN / "kimi_k2_swe_32xh200_h200_ib.sbatch").read_text()
    assert "#   python -m workers.inference.sglang.keyed sglang.launch_server \\" in text
    assert "#   python -m workers.inference.sglang.keyed smg.launch_router \\" in text
    assert "--api-key" not in text and "admin_token'" not in text  # the token is added in memory (keyed.py)
    assert "#     --enable-return-routed-experts \\" in text and "#     --moe-a2a-backend deepep \\" in text
    assert "    NVSHMEM_IB_ENABLE_IBGDA=1 \\" in text  # the step's own environment, before srun
