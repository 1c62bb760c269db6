"""``preflight=true`` in the plan and the rendered hetjob: the preflight step comes first.

The step runs after the prologue (so cluster.env and cluster.setup apply to it) and before
the first role's srun; a failure exits the batch script before any role starts. With the
default ``preflight=false`` the script is unchanged (the golden files stay as they are).
"""
from __future__ import annotations

import subprocess

import pytest

from launcher.plan import PlanError
from tests.conftest import GLM5, TINY_SLURM, compose, plan, plan_error
from tests.unit.conftest import render, srun_steps

PREFLIGHT_CALL = '"$SLURMRL_PYTHON" -m workers.preflight job --run-dir "$SLURMRL_RUN_DIR"'


@pytest.mark.parametrize("overrides", [TINY_SLURM, GLM5], ids=["tiny", "glm5"])
def test_preflight_step_runs_before_every_role(overrides, tmp_path):
    text = render(overrides + ["preflight=true"])
    call = text.index(PREFLIGHT_CALL)
    assert text.index("export SLURMRL_RUN_DIR=") < call  # after the prologue's exports and setup lines
    assert call < text.index("\nslurmrl_step ")  # before the first role's step
    block = text[call:text.index("\nslurmrl_step ")]
    assert "  exit 1\nfi\n" in block and "preflight failed: no role was started" in block
    assert len(srun_steps(text)) == len(plan(overrides).roles)  # no extra role step; preflight starts its own
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    assert PREFLIGHT_CALL not in render(overrides)  # off by default


def test_plan_carries_the_flag_and_the_profile_limits():
    assert plan(GLM5 + ["preflight=true"]).preflight and not plan(GLM5).preflight
    limits = compose(GLM5).cluster.preflight
    assert limits.gpu_name == "H200" and limits.min_nvlinks_per_gpu == 18
    assert limits.min_busbw_gbps["all_reduce"] > 0 and limits.min_busbw_gbps_intra_node["all_reduce"] > 0
    assert compose(TINY_SLURM).cluster.preflight.min_busbw_gbps == {}  # CPU profile: report only


def test_preflight_needs_slurm():
    assert plan_error(["preflight=true"]) == ("preflight=true runs as the first step of the Slurm job "
                                              "(cluster.backend=slurm); to check this machine run "
                                              "`slurmrl-preflight standalone --out DIR`")


def test_bad_limits_are_refused_before_submitting():
    msg = plan_error(TINY_SLURM + ["preflight=true", "+cluster.preflight.expect_gpus_per_node.trainers=1"])
    assert msg == ("cluster.preflight.expect_gpus_per_node has unknown names ['trainers']; "
                   "choose from ['control', 'inference', 'trainer']")
    msg = plan_error(GLM5 + ["preflight=true", "+cluster.preflight.min_busbw_gbps.allreduce=300"])
    assert msg.startswith("cluster.preflight.min_busbw_gbps has unknown names ['allreduce']")
    with pytest.raises(PlanError, match=r"cluster.preflight.max_bytes\(1024\)"):
        plan(TINY_SLURM + ["preflight=true", "cluster.preflight.max_bytes=1024"])
    plan(TINY_SLURM + ["cluster.preflight.max_bytes=1024"])  # not checked while preflight is off
