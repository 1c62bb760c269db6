"""Per-het-group Slurm options, the GPU groups' whole-node memory and containers (pyxis, apptainer)."""
from __future__ import annotations

import pytest

from tests.conftest import GLM5, plan_error
from tests.unit.conftest import render, sbatch_blocks, srun_steps


def test_group_flags_land_only_on_their_group():
    text = render([*GLM5, "launcher.control_placement=own_node", "+cluster.groups.trainer.sbatch_flags.constraint=h200",
                   "+cluster.groups.control.sbatch_flags.reservation=ctl", "+cluster.sbatch_flags.comment=all"])
    blocks = sbatch_blocks(text)
    control, trainer = blocks[0], blocks[-1]
    assert "--constraint=h200" in trainer and not any(f.startswith("--constraint") for f in control)
    assert "--reservation=ctl" in control and "--reservation=ctl" not in trainer
    assert all("--comment=all" in b for b in blocks)  # job-wide flags stay on every group


def test_gpu_groups_take_the_whole_node_memory_and_cpu_groups_do_not():
    blocks = sbatch_blocks(render([*GLM5, "launcher.control_placement=own_node"]))
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


def test_glm5_plan_uses_exactly_28_nodes_with_control_on_the_trainer():
    from tests.conftest import plan

    p = plan(GLM5)
    assert sum(c.num_nodes for c in p.components) == 28 and all(c.num_gpus_per_node for c in p.components)
    trainer = p.role("trainer")
    for name in ("orchestrator", "router"):
        r = p.role(name)
        assert r.het_group == trainer.het_group and r.overlap and r.num_nodes == 1
    steps = srun_steps(render(GLM5))
    orch = next(s for s in steps if "--job-name=orchestrator" in s)
    assert "--overlap" in orch and f"--het-group={trainer.het_group}" in orch and "--nodes=1" in orch
    assert not any("--overlap" in s for s in steps if "--job-name=trainer" in s)
    own = plan([*GLM5, "launcher.control_placement=own_node"])
    assert sum(c.num_nodes for c in own.components) == 29 and own.components[0].name == "control"


def test_control_on_trainer_topology_puts_orchestrator_on_trainer_node0():
    """The run-time topology (what the roles compute from Slurm's variables) agrees with the plan."""
    from launcher.render import layout_of
    from tests.conftest import plan
    from workers.common.topology import slurm_topology

    p = plan(GLM5)
    k = p.role("trainer").het_group
    env = {"SLURMRL_ROLE": "orchestrator", "SLURMRL_LAYOUT": layout_of(p), "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_ID": "77", "SLURMRL_PORT_MIN": "20000", "SLURMRL_PORT_SPAN": "64", "SLURMRL_NUM_PORT_SLOTS": "150",
           "SLURMRL_RUN_DIR": "/r", **{f"SLURM_JOB_NODELIST_HET_GROUP_{i}": f"g{i}-[1-{c.num_nodes}]"
                                       for i, c in enumerate(p.components)}}
    topo = slurm_topology(env)
    assert topo.bind_host == f"g{k}-1"
