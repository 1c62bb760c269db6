"""``experiment=one_gpu_node``: a user's checkpoint (model.path) on this machine's GPUs with a
pretrained model's defaults, and the hint a GPU user gets from the CPU toy default."""
from __future__ import annotations

import pytest

from launcher.gpus import LocalGPUs
from launcher.launch import launch
from launcher.model_path import resolve_model_path
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.fakes.fake_nvml import FakeGPU, FakeNVML, NVMLError_DriverNotLoaded
from tests.models.hf_dirs import llama_dir

PRESET = ["experiment=one_gpu_node"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("ckpt") / "tiny-llama", tokenizer_vocab=300, vocab_size=320)


def preset(path, *more):
    cfg = compose([*PRESET, f"model.path={path}", *more])
    return resolve_model_path(cfg, {"path", *(m.split("=")[0].split(".", 1)[1] for m in more if m.startswith("model."))})


def test_needs_only_model_path_and_has_a_pretrained_models_defaults(checkpoint):
    cfg = preset(checkpoint)
    t = cfg.trainer
    assert (t.dtype, t.master_dtype, t.lr, t.aux_loss_coef) == ("bfloat16", "float32", 1e-6, 0.0)
    assert cfg.model.family == "llama" and cfg.model.path == str(checkpoint)
    assert cfg.env.name == "reverse_text"  # a real task, in the checkpoint's own chat template
    assert (cfg.inference.backend, cfg.inference.device, cfg.inference.dtype) == ("embedded", "cuda", "bfloat16")
    plan = build_plan(cfg, gpus=LocalGPUs(("0",), "NVML"))  # one H200: trainer and engine share it
    assert [(p.role, p.cuda_visible_devices) for p in plan.gpu_placement] == [
        ("trainer", "0"), ("inference", "0"), ("orchestrator", "")]
    eight = build_plan(preset(checkpoint, "trainer.num_ranks=4", "inference.num_workers=4"),
                       gpus=LocalGPUs(tuple(str(i) for i in range(8)), "NVML"))
    assert [p.cuda_visible_devices for p in eight.gpu_placement] == [*"01234567", ""]


def test_without_a_checkpoint_the_plan_says_what_to_add():
    with pytest.raises(PlanError, match=r"experiment=one_gpu_node trains your checkpoint: add model.path=DIR"):
        build_plan(compose(PRESET), gpus=LocalGPUs(("0",), "NVML"))


def test_the_sglang_servers_take_the_same_checkpoint(checkpoint):
    cfg = preset(checkpoint, "inference=sglang_node", "inference.sglang.mem_fraction_static=0.3")
    assert cfg.inference.sglang.model_path == str(checkpoint)
    plan = build_plan(cfg, gpus=LocalGPUs(("0", "1"), "NVML"))
    assert [(p.role, p.cuda_visible_devices) for p in plan.gpu_placement] == [
        ("trainer", "0"), ("inference", "1"), ("orchestrator", ""), ("router", "")]


@pytest.mark.parametrize("gpus, hinted", [(2, True), (0, False)])
def test_the_default_run_on_a_gpu_machine_names_the_preset(gpus, hinted, tmp_path, monkeypatch, capsys):
    """``slurmrl`` with no overrides (tiny_local; a dry run here) on a machine whose NVML (the fake)
    shows GPUs tells the user the preset exists; on a CPU machine it says nothing of it."""
    nvml = FakeNVML([FakeGPU() for _ in range(gpus)], init_error=None if gpus else NVMLError_DriverNotLoaded)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launch(compose([f"cluster.runs_root={tmp_path}"])) == 0
    out = capsys.readouterr().out
    assert ("experiment=one_gpu_node model.path=DIR" in out) == hinted, out
    if hinted:
        assert "this machine has 2 GPU(s) (NVML)" in out and "GPU placement trainer: [0] 0" in out
    else:
        assert "GPUs: none (NVML: NVMLError_DriverNotLoaded): every role on the CPU" in out
