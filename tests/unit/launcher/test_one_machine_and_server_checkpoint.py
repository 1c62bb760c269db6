"""Issue 47 item 16: a local plan says it is one machine (never "all nodes: 6" for 8 GPUs), and
``model.path`` is the one way to point a run at a checkpoint: SGLang servers whose preset names
another directory load it too; an explicit, different ``inference.sglang.model_path`` is refused
with both keys named (a dry run through the CLI, as a user types it)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.gpus import LocalGPUs
from launcher.model_path import explicit_model_keys, explicit_server_path, resolve_model_path
from launcher.plan import PlanError, build_plan
from tests.conftest import REPO, compose
from tests.models.hf_dirs import llama_dir
from workers.common.config.run import load_run_config

SERVERS = ["inference=sglang", "inference.num_workers=1", "inference.worker.tp=1", "inference.worker.ep=1",
           "inference.worker.dp_attention=1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("ckpt") / "tiny-llama", tokenizer_vocab=300, vocab_size=320)


def resolved(*overrides):
    return resolve_model_path(compose(list(overrides)), explicit_model_keys(overrides), explicit_server_path(overrides))


def test_an_eight_gpu_local_plan_says_one_machine_not_six_nodes(checkpoint):
    cfg = resolved("experiment=one_gpu_node", f"model.path={checkpoint}", "trainer.num_ranks=4",
                   "inference.num_workers=4")
    lines = build_plan(cfg, gpus=LocalGPUs(tuple(str(i) for i in range(8)), "NVML")).summary()
    assert not any("all nodes" in ln or "het group" in ln for ln in lines), lines
    assert ("GPUs in use: trainer 4 + inference 4 = 8 GPU(s) on ONE machine (local backend: every process here, "
            "no Slurm job)") in lines
    shared = build_plan(resolved("experiment=one_gpu_node", f"model.path={checkpoint}"),
                        gpus=LocalGPUs(("0",), "NVML")).summary()
    assert any(ln.startswith("GPUs in use: trainer 1 + inference 1 = 1 GPU(s)") and "shared" in ln for ln in shared)
    slurm = build_plan(compose(["experiment=glm5_swe_28xh200", "launcher.dry_run=true"])).summary()
    assert "GPU nodes: prefill 4 + decode 8 + trainer 16 = 28; all nodes: 28" in slurm  # Slurm plans keep nodes


def test_explicit_server_path_is_read_from_the_command_line():
    assert explicit_server_path(["inference.sglang.model_path=/x"]) and explicit_server_path(["++inference.sglang.model_path=/x"])
    assert not explicit_server_path(["model.path=/x", "inference.sglang.router.policy=x"])


def test_model_path_points_the_glm5_servers_at_the_same_checkpoint(checkpoint):
    """The glm5 experiment's servers name ${cluster.shared_root}/models/GLM-5; with model.path they load
    the run's checkpoint (the composition alone: GLM-5's 128-rank layout needs GLM-5's config.json)."""
    preset = compose(["experiment=glm5_swe_28xh200"])
    assert preset.model.path == "" and preset.inference.sglang.model_path.endswith("/models/GLM-5")
    cfg = resolved("experiment=glm5_swe_28xh200", f"model.path={checkpoint}")
    assert cfg.inference.sglang.model_path == str(checkpoint) == cfg.model.path
    with pytest.raises(PlanError, match=r"model.path=.*tiny-llama and inference.sglang.model_path=/elsewhere name "
                                        r"different checkpoints.*set model.path alone"):
        resolved("experiment=glm5_swe_28xh200", f"model.path={checkpoint}", "inference.sglang.model_path=/elsewhere")
    same = resolved("experiment=glm5_swe_28xh200", f"model.path={checkpoint}",
                    f"inference.sglang.model_path={checkpoint}/")  # the same directory, spelled otherwise: fine
    assert same.inference.sglang.model_path == f"{checkpoint}/"


def cli(tmp_path, *args):
    cmd = [sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}", "experiment=one_gpu_node",
           "cluster.num_gpus_per_node=2", "launcher.dry_run=true", *SERVERS, *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_dry_run_servers_load_model_path_or_both_keys_are_named(checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    out = cli(tmp_path, f"model.path={checkpoint}", f"launcher.run_dir={run_dir}")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "GPUs in use: trainer 1 + inference 1 = 2 GPU(s) on ONE machine" in out.stdout and "all nodes" not in out.stdout
    cfg = load_run_config(run_dir / "config" / "run.yaml")
    assert cfg.inference.sglang.model_path == str(checkpoint)  # not the preset's ${cluster.shared_root}/models/...
    bad = cli(tmp_path, f"model.path={checkpoint}", "inference.sglang.model_path=/elsewhere")
    assert bad.returncode != 0
    assert "model.path=" in bad.stderr and "inference.sglang.model_path=/elsewhere name different checkpoints" in bad.stderr
