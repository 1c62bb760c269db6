"""Rendered sbatch scripts: golden files, structure, admin template overrides, StrictUndefined.

Refresh the golden files after an intended change with
    SLURMRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/launcher/test_render_golden.py
and review the diff like code.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.plan import PlanError
from launcher.render import PACKAGED_TEMPLATES
from tests.conftest import GLM5, TINY_SLURM, plan
from tests.unit.conftest import GOLDEN, render, sbatch_blocks, srun_steps

SITE = [*GLM5, "launcher.control_placement=own_node", "cluster.container.runtime=pyxis", "cluster.container.image=/lustre/images/slurmrl.sqsh",
        "cluster.container.mounts=[/lustre:/lustre]", "+cluster.groups.trainer.sbatch_flags.constraint=h200",
        "+cluster.groups.decode.sbatch_flags.exclusive=", "+cluster.groups.control.sbatch_flags.mem=64G"]
"""A site profile's per-group flags and a pyxis container (each group's flags only on its block)."""
CASES = {"tiny_local_local_slurm.sbatch": TINY_SLURM, "glm5_swe_28xh200_h200_ib.sbatch": GLM5,
         "glm5_pyxis_groups_h200_ib.sbatch": SITE}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = render(CASES[name])
    path = GOLDEN / name
    if os.environ.get("SLURMRL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: create it with SLURMRL_UPDATE_GOLDEN=1 pytest {__file__}"
    assert text == path.read_text(), (f"rendered script differs from {path}; if the change is intended, refresh with "
                                      f"SLURMRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest {Path(__file__).name} "
                                      f"and review the diff")


@pytest.mark.parametrize("overrides", [TINY_SLURM, GLM5], ids=["tiny", "glm5"])
def test_script_structure(overrides, tmp_path):
    text = render(overrides)
    p = plan(overrides)
    blocks, steps = sbatch_blocks(text), srun_steps(text)
    assert len(blocks) == len(p.components)  # one #SBATCH hetjob between consecutive components
    keys = [[f.split("=")[0] for f in fl] for fl in blocks + steps]
    assert [k == sorted(k) for k in keys] == [True] * len(keys)  # flags sorted by name, like submitit
    groups = sorted(int(f.split("=")[1]) for s in steps for f in s if f.startswith("--het-group="))
    assert groups == sorted(r.het_group for r in p.roles)  # one step per role
    assert all("--kill-on-bad-exit=1" in s and "--distribution=block" in s for s in steps)
    assert "set -euo pipefail" in text and 'exec "$SLURMRL_PYTHON" -m launcher.supervisor' in text
    assert "--requeue" in blocks[0] and any(f.startswith("--signal=B:USR1@") for f in blocks[0])
    assert "%t" not in text and text.count("$SLURM_PROCID.log") == len(p.roles)  # per-task logs from the task env
    assert "$((" not in text  # no arithmetic on host lists or ports; supervision is launcher/supervisor.py
    gpu_nodes = sum(int(f.split("=")[1]) for b in blocks if any(f.startswith("--gpus-per-node") for f in b)
                    for f in b if f.startswith("--nodes="))
    assert gpu_nodes == p.num_gpu_nodes
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_glm5_components_add_up_to_28():
    blocks = sbatch_blocks(render(GLM5))
    nodes = [int(f.split("=")[1]) for b in blocks for f in b if f.startswith("--nodes=")]
    gpus = [any(f.startswith("--gpus-per-node=8") for f in b) for b in blocks]
    assert nodes == [4, 8, 16] and gpus == [True, True, True]  # control on the trainer's first node
    assert sum(nodes) == 28


def test_values_are_shell_quoted():
    text = render(TINY_SLURM, env={"NCCL_SOCKET_IFNAME": "^lo,docker", "X": "a b"}, account="it's")
    assert "export NCCL_SOCKET_IFNAME='^lo,docker'" in text and "export X='a b'" in text
    assert "#SBATCH --account='it'\"'\"'s'" in text


def test_admin_template_dir_overrides_one_snippet(tmp_path):
    (tmp_path / "steps").mkdir()
    trainer = (PACKAGED_TEMPLATES / "steps" / "trainer.sh.j2").read_text()
    (tmp_path / "steps" / "trainer.sh.j2").write_text("# site rule: trainers load the site NCCL plugin\n" + trainer)
    text = render(TINY_SLURM, template_dir=str(tmp_path))
    assert "# site rule: trainers load the site NCCL plugin" in text
    assert f"Rendered from {tmp_path} (cluster.template_dir)" in text
    assert text.count("\nslurmrl_step ") == 3  # the other snippets still come from the package


def test_admin_copy_of_the_whole_tree_renders_the_same(tmp_path):
    shutil.copytree(PACKAGED_TEMPLATES, tmp_path / "t")
    text = render(TINY_SLURM, template_dir=str(tmp_path / "t"))
    assert re.sub(r"Rendered from .*\n", "", text) == re.sub(r"Rendered from .*\n", "", render(TINY_SLURM))


def test_undefined_variable_is_an_error(tmp_path):
    (tmp_path / "prologue.sh.j2").write_text("export SITE={{ site_scratch_dir }}\n")
    with pytest.raises(PlanError, match="undefined variable: 'site_scratch_dir' is undefined"):
        render(TINY_SLURM, template_dir=str(tmp_path))


def test_missing_template_dir_names_the_key():
    with pytest.raises(PlanError, match="cluster.template_dir='/nonexistent/templates' is not a directory"):
        render(TINY_SLURM, template_dir="/nonexistent/templates")
