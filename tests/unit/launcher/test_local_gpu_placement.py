"""One GPU node without Slurm (launcher/gpus.py): which GPUs the machine has (NVML through
tests/fakes/fake_nvml.py, CUDA_VISIBLE_DEVICES, cluster.num_gpus_per_node), which process gets
which, what is refused before anything starts, and the environment real child processes get."""
from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.gpus import LocalGPUs, _ctypes_count, detect_gpus
from launcher.launch import prepare, write
from launcher.local_backend import LocalBackend
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.fakes.fake_nvml import FakeGPU, FakeNVML, NVMLError_DriverNotLoaded
from workers.common.protocol import RunPaths

EIGHT = LocalGPUs(tuple(str(i) for i in range(8)), "NVML")
ONE = LocalGPUs(("0",), "NVML")
CUDA = ["inference.device=cuda"]


def placement(plan) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in plan.gpu_placement:
        out.setdefault(p.role, []).append(p.cuda_visible_devices)
    return out


def refused(overrides: list[str], gpus: LocalGPUs) -> str:
    with pytest.raises(PlanError) as e:
        build_plan(compose(overrides), gpus=gpus)
    return str(e.value)


def test_detect_counts_nvml_within_the_launchers_visible_devices():
    cfg = compose([])
    nvml = FakeNVML([FakeGPU() for _ in range(8)])
    assert detect_gpus(cfg, {}, nvml) == EIGHT
    assert nvml.initialized == 0  # shut down again
    assert detect_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "4,5"}, nvml).ids == ("4", "5")
    assert detect_gpus(cfg, {"CUDA_VISIBLE_DEVICES": ""}, nvml).ids == ()
    assert detect_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "2,-1,3"}, nvml).ids == ("2",)  # CUDA stops at -1
    none = detect_gpus(cfg, {}, FakeNVML([], init_error=NVMLError_DriverNotLoaded))
    assert none.ids == () and "DriverNotLoaded" in none.source
    set_ = compose(["cluster.num_gpus_per_node=2"])
    assert detect_gpus(set_, {}, nvml).ids == ("0", "1")  # the key wins over NVML
    assert detect_gpus(set_, {"CUDA_VISIBLE_DEVICES": "6,7,5"}, nvml).ids == ("6", "7")
    with pytest.raises(PlanError, match=r"cluster.num_gpus_per_node\(2\) > the 1 GPU"):
        detect_gpus(set_, {"CUDA_VISIBLE_DEVICES": "3"}, nvml)


def test_without_pynvml_the_drivers_library_is_asked_directly():
    assert _ctypes_count("libnvidia-ml-absent.so.1") == (0, "no NVIDIA driver (libnvidia-ml-absent.so.1 not found)")
    assert _ctypes_count("libc.so.6") == (0, "NVML: libc.so.6 has no nvmlInit_v2")  # a library, but not NVML


def test_eight_gpus_trainer_first_then_one_engine_each():
    plan = build_plan(compose(["trainer.num_ranks=4", "inference.num_workers=4", *CUDA]), gpus=EIGHT)
    assert placement(plan) == {"trainer": ["0", "1", "2", "3"], "inference": ["4", "5", "6", "7"],
                               "orchestrator": [""]}
    text = "\n".join(plan.summary())
    assert "GPUs: 8 (NVML); one GPU set per process" in text
    assert "GPU placement trainer: [0] 0, [1] 1, [2] 2, [3] 3" in text
    assert "GPU placement inference: [0] 4, [1] 5, [2] 6, [3] 7" in text


def test_part_of_the_node_and_engines_on_the_cpu():
    plan = build_plan(compose(["trainer.num_ranks=2", "inference.num_workers=1", *CUDA]), gpus=EIGHT)
    assert placement(plan) == {"trainer": ["0", "1"], "inference": ["2"], "orchestrator": [""]}
    plan = build_plan(compose([]), gpus=EIGHT)  # tiny_local: engines on the CPU see no GPU
    assert placement(plan) == {"trainer": ["0"], "inference": ["", ""], "orchestrator": [""]}


def test_one_gpu_is_shared_and_the_plan_says_so():
    plan = build_plan(compose(CUDA), gpus=ONE)
    assert placement(plan) == {"trainer": ["0"], "inference": ["0", "0"], "orchestrator": [""]}
    assert "ONE GPU (0) shared by every role: a 1-GPU machine" in "\n".join(plan.summary())


def test_no_gpus_sets_nothing():
    plan = build_plan(compose([]), gpus=LocalGPUs((), "no NVIDIA driver"))
    assert plan.gpu_placement == ()
    assert "GPUs: none (no NVIDIA driver): every role on the CPU" in plan.summary()
    # a plan built without the launcher's detection: cluster.num_gpus_per_node of them (0 here)
    assert build_plan(compose([])).gpu_placement == ()


@pytest.mark.parametrize("overrides, gpus, words", [
    (["trainer.num_ranks=1", "inference.num_workers=2", *CUDA], LocalGPUs(("0", "1"), "NVML"),
     ["the roles ask for 3 GPUs", "trainer.num_ranks(1) x 1", "inference.num_workers(2) x inference.device=cuda: 1",
      "this machine has 2 (NVML)", "CUDA_VISIBLE_DEVICES=<one GPU>"]),
    (["trainer.num_ranks=2", "inference.num_workers=1", *CUDA], ONE, ["the roles ask for 3 GPUs", "trainer.num_ranks(2)"]),
    (["trainer.num_ranks=2", "inference.num_workers=2"], ONE, ["trainer.num_ranks(2)", "NCCL refuses two ranks"]),
    (CUDA, LocalGPUs((), "no NVIDIA driver (libnvidia-ml.so.1 not found)"),
     ["inference.num_workers(2) x inference.device=cuda: 1", "has none (no NVIDIA driver", "inference.device=cpu", "cluster.num_gpus_per_node=N launcher.dry_run=true"]),
    (["inference.device=cuda:3"], EIGHT, ["inference.device=cuda:3", "use inference.device=cuda"]),
    ([*CUDA, "weights=broadcast"], ONE, ["weights.transport=broadcast over NCCL on one shared GPU", "weights=filesystem"]),
    (["weights=broadcast"], EIGHT, ["the engines are on the CPU (inference.device=cpu)", "weights.backend=gloo"]),
])
def test_what_the_machine_cannot_hold_is_refused(overrides, gpus, words):
    msg = refused(overrides, gpus)
    for w in words:
        assert w in msg, (w, msg)


def test_broadcast_across_gpus_of_their_own_is_placed():
    plan = build_plan(compose(["inference.num_workers=1", *CUDA, "weights=broadcast"]), gpus=EIGHT)
    assert placement(plan) == {"trainer": ["0"], "inference": ["1"], "orchestrator": [""]}


def test_env_and_plan_json_of_each_process(tmp_path, monkeypatch):
    """prepare() detects this machine's GPUs (here: the launcher's CUDA_VISIBLE_DEVICES), write()
    records each process's CUDA_VISIBLE_DEVICES in config/plan.json, role_envs() exports it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    cfg = compose(["inference.num_workers=2", *CUDA, f"cluster.runs_root={tmp_path}",
                   f"launcher.run_dir={tmp_path / 'run'}"])
    prep = prepare(cfg)
    paths = write(prep)
    plan_json = json.loads((paths.config_dir / "plan.json").read_text())
    assert [(p["role"], p["rank"], p["cuda_visible_devices"]) for p in plan_json["gpu_placement"]] == [
        ("trainer", 0, "3"), ("inference", 0, "5"), ("inference", 1, "6"), ("orchestrator", 0, "")]
    assert plan_json["local_gpus"] == {"ids": ["3", "5", "6"], "source": "CUDA_VISIBLE_DEVICES='3,5,6'"}
    envs = LocalBackend(prep.cfg, prep.plan, paths).role_envs()
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs["inference"]] == ["5", "6"]
    assert envs["trainer"][0]["CUDA_VISIBLE_DEVICES"] == "3" and envs["orchestrator"][0]["CUDA_VISIBLE_DEVICES"] == ""


def test_real_child_processes_get_their_gpus(tmp_path, monkeypatch):
    """Every role's process, started by the local backend as in a run (tests/helpers/env_probe.py in place of
    the role's module), sees its own CUDA_VISIBLE_DEVICES and its topology."""
    monkeypatch.setenv("SLURMRL_PROBE_EXPECT", "5")  # the main roles wait for the servers' probes (env_probe.py)
    cfg = compose(["trainer.num_ranks=2", "inference.num_workers=2", *CUDA, "launcher.shutdown_grace_s=2"])
    plan = build_plan(cfg, gpus=LocalGPUs(("1", "2", "4", "7"), "NVML"))
    plan = dataclasses.replace(plan, roles=tuple(dataclasses.replace(r, module="tests.helpers.env_probe") for r in plan.roles))
    paths = RunPaths(tmp_path).ensure()
    assert LocalBackend(cfg, plan, paths).run() == 0
    got = {f.stem[len("probe_"):]: json.loads(f.read_text()) for f in tmp_path.glob("probe_*.json")}
    assert {k: v["CUDA_VISIBLE_DEVICES"] for k, v in got.items()} == {
        "trainer_0": "1", "trainer_1": "2", "inference_0": "4", "inference_1": "7", "orchestrator_0": ""}
    assert got["inference_1"]["topology"]["bind_port"] == int(got["inference_1"]["topology"]["inference_urls"][1]
                                                               .rsplit(":", 1)[1])
    assert len({v["pid"] for v in got.values()}) == 5
