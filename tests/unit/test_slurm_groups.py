"""Per-het-group Slurm options, the GPU groups' whole-node memory and containers (pyxis, apptainer)."""
from __future__ import annotations

import pytest

from tests.conftest import GLM5, plan_error
from tests.unit.conftest import render, sbatch_blocks, srun_steps


def test_group_flags_land_only_on_their_group():
    text = render([*GLM5, "+cluster.groups.trainer.sbatch_flags.constraint=h200",
                   "+cluster.groups.control.sbatch_flags.reservation=ctl", "+cluster.sbatch_flags.comment=all"])
    blocks = sbatch_blocks(text)
    control, trainer = blocks[0], blocks[-1]
    assert "--constraint=h200" in trainer and not any(f.startswith("--constraint") for f in control)
    assert "--reservation=ctl" in control and "--reservation=ctl" not in trainer
    assert all("--comment=all" in b for b in blocks)  # job-wide flags stay on every group


def test_gpu_groups_take_the_whole_node_memory_and_cpu_groups_do_not():
    blocks = sbatch_blocks(render(GLM5))
    gpu = [b for b in blocks if any(f.startswith("--gpus-per-node") for f in b)]
    cpu = [b for b in blocks if b not in gpu]
    assert gpu and all("--mem=0" in b for b in gpu)
    assert cpu and not any(f.startswith("--mem=0") for b in cpu for f in b)
    assert all("--mem=0" not in b for b in sbatch_blocks(render([*GLM5, "cluster.gpu_mem_whole_node=false"])))


def test_pyxis_flags_on_every_srun_step():
    text = render([*GLM5, "cluster.container.runtime=pyxis", "cluster.container.image='nvcr.io#nvidia/pytorch:25.01-py3'",
                   "cluster.container.mounts=[/lustre:/lustre,/home:/home]", "cluster.container.workdir=/lustre/w"])
    steps = srun_steps(text)
    # shell-quoted: '#' would start a comment
    assert steps and all("--container-image='nvcr.io#nvidia/pytorch:25.01-py3'" in s for s in steps)
    assert all("--container-mounts=/lustre:/lustre,/home:/home" in s and "--container-workdir=/lustre/w" in s
               for s in steps)


def test_apptainer_wraps_each_step_command():
    text = render([*GLM5, "cluster.container.runtime=apptainer", "cluster.container.image=/lustre/img.sif",
                   "cluster.container.mounts=[/lustre:/lustre]"])
    assert "exec apptainer exec --nv --bind /lustre:/lustre /lustre/img.sif \"$SLURMRL_PYTHON\" -m workers.trainer" in text
    assert not any("--container-image" in f for s in srun_steps(text) for f in s)


@pytest.mark.parametrize("overrides,needle", [
    (["cluster.container.runtime=pyxis"], "cluster.container.image is empty"),
    (["cluster.container.runtime=docker", "cluster.container.image=x"], "cluster.container.runtime"),
])
def test_bad_container_settings_are_refused(overrides, needle):
    assert needle in plan_error([*GLM5, *overrides])


def test_containers_are_refused_for_local_runs():
    assert "starts local processes" in plan_error(["cluster.container.runtime=pyxis", "cluster.container.image=x"])


def test_flags_for_a_group_the_plan_lacks_are_refused():
    msg = plan_error([*GLM5, "+cluster.groups.inference.sbatch_flags.exclusive="])  # GLM-5 serves prefill/decode
    assert "cluster.groups.inference.sbatch_flags" in msg and "prefill" in msg
