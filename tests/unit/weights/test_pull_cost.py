"""weights.transport=filesystem + weights.delta into SGLang, at plan time: the plan's line, the coordinator, the flag.

The GLM-5 preset (EP over 32-GPU servers) with its weights switched to the filesystem: the plan must print
the per-rank pull figure (sglang/patch_cost.py's per-rank bytes: far below the whole patch), the orchestrator must
get the pulling coordinator (the plain one asked SGLang to load patch steps from disk, which it cannot),
and every server must be started with the loader that pulls.
"""
from __future__ import annotations

import logging

import pytest

from launcher.plan import build_plan
from tests.conftest import compose
from tests.unit.inference.sglang_cases import PRESETS
from workers.common.protocol import RunPaths
from workers.inference.sglang.args import weight_loader_args
from workers.weights.sglang.patch_cost import delta_update_cost, model_split, server_layouts
from workers.weights.sglang.wire import DELTA_LOADER
from workers.weights.filesystem.coordinator import FilesystemCoordinator, make_coordinator
from workers.weights.sglang.pull_cost import pull_storage_bytes
from workers.weights.sglang.pull_coordinator import FilesystemSGLangCoordinator

GLM5 = PRESETS["glm5_swe_28xh200"] + ["weights=filesystem", "cluster.nic_gb_s=50"]


@pytest.fixture(scope="module")
def delta_cfg():
    return compose(GLM5 + ["weights.delta=true"])


def test_the_plan_prints_bytes_per_gpu_with_per_rank_pull(delta_cfg):
    line = build_plan(delta_cfg).weight_update
    c = delta_update_cost(model_split(delta_cfg.model), server_layouts(delta_cfg), item_bytes=2,
                          fraction=delta_cfg.weights.delta_fraction_assumed, nic_gb_s=50, senders=1)
    assert line.startswith("sparse patches pulled per rank from run_dir/weights"), line
    assert f"{c.rank_bytes_per_gpu / 1e9:.2f} GB per inference GPU per update" in line, line
    assert f"the whole patch is {c.whole_bytes_per_gpu / 1e9:.2f} GB" in line
    assert c.rank_bytes_per_gpu < c.whole_bytes_per_gpu / 5  # EP: a rank holds a small share of the experts
    assert f"{c.rank_bytes_per_gpu / 50e9:.2f} s at cluster.nic_gb_s=50" in line
    assert f"weights.delta_fraction_assumed={delta_cfg.weights.delta_fraction_assumed:g}" in line
    # the storage term: non-expert entries once per node, every expert once per server (+ EPLB copies)
    split, layouts = model_split(delta_cfg.model), server_layouts(delta_cfg)
    storage = pull_storage_bytes(split, layouts, bytes_per_element=c.bytes_per_element, gpus_per_node=8)
    by_hand = sum(lay.count * (lay.tp // 8 * split.other + split.routed * (split.num_experts + lay.redundant_experts)
                               / split.num_experts) for lay in layouts) * c.bytes_per_element
    assert storage == pytest.approx(by_hand) and storage < c.rank_total_bytes
    fs = delta_cfg.cluster.shared_fs_gb_s
    assert f"the shared filesystem serves {storage / 1e9:.1f} GB" in line and f"cluster.shared_fs_gb_s={fs:g}" in line
    seconds = max(c.rank_bytes_per_gpu / 50e9, storage / (fs * 1e9))
    assert f"~{seconds:.2f} s per update" in line


def test_a_faster_filesystem_shortens_the_pull_down_to_the_nic(delta_cfg):
    """At 100 GB/s the storage decides (many ranks); at 100 TB/s the largest rank's NIC does."""
    slow = build_plan(compose(GLM5 + ["weights.delta=true", "cluster.shared_fs_gb_s=100"])).weight_update
    fast = build_plan(compose(GLM5 + ["weights.delta=true", "cluster.shared_fs_gb_s=100000"])).weight_update
    c = delta_update_cost(model_split(delta_cfg.model), server_layouts(delta_cfg), item_bytes=2,
                          fraction=delta_cfg.weights.delta_fraction_assumed, nic_gb_s=50, senders=1)

    def total(line):
        return float(line.split(": ~")[1].split(" s per update")[0])
    assert total(fast) == pytest.approx(c.rank_bytes_per_gpu / 50e9, abs=0.006)
    assert total(fast) < total(slow)


def test_dense_filesystem_steps_print_no_patch_line():
    assert build_plan(compose(GLM5 + ["weights.delta=false"])).weight_update == ""


def test_the_orchestrator_pulls_and_the_servers_carry_the_loader(delta_cfg, tmp_path):
    log = logging.getLogger("test")
    assert isinstance(make_coordinator(delta_cfg, RunPaths(tmp_path), log=log), FilesystemSGLangCoordinator)
    assert weight_loader_args(delta_cfg) == ["--custom-weight-loader", DELTA_LOADER]
    dense = compose(GLM5 + ["weights.delta=false"])
    coord = make_coordinator(dense, RunPaths(tmp_path), log=log)
    assert type(coord) is FilesystemCoordinator and weight_loader_args(dense) == []
