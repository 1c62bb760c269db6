"""``inference=sglang_node`` without Slurm: SGLang servers and smg as local processes, each server on
tp GPUs of its own, ports laid out as in a Slurm job (their argv also goes through SGLang's and
smg's own parsers: tests/unit/inference/test_sglang_parser.py, case ``local_node``)."""
from __future__ import annotations

import pytest

from launcher.gpus import LocalGPUs
from launcher.plan import PlanError, build_plan
from tests.conftest import compose
from tests.unit.inference.sglang_cases import LOCAL_NODE, local_tasks, value
from workers.common.topology import PORT_ROUTER, PORT_WEIGHTS, PORT_SERVERS
from workers.inference.sglang.ports import extra_ports


def test_servers_get_their_tp_gpus_and_the_jobs_port_layout():
    servers, router = local_tasks()
    assert [t.env["CUDA_VISIBLE_DEVICES"] for t in servers] == ["2,3", "4,5"]  # after trainer ranks 0, 1
    assert router.env["CUDA_VISIBLE_DEVICES"] == ""
    assert {t.env["SGLANG_SET_CPU_AFFINITY"] for t in servers} == {"0"}  # each sees cuda:0..: no shared pinning
    urls = servers[0].topo.inference_urls
    base = int(urls[0].rsplit(":", 1)[1]) - PORT_SERVERS
    assert urls == tuple(f"http://127.0.0.1:{base + PORT_SERVERS + 2 * i}" for i in range(2))
    assert router.topo.router_url == f"http://127.0.0.1:{base + PORT_ROUTER}"
    assert servers[1].topo.weights_group_addr == f"127.0.0.1:{base + PORT_WEIGHTS}"
    for t in servers:
        assert (t.topo.replica, t.topo.bind_port) == (t.rank, int(urls[t.rank].rsplit(":", 1)[1]))
        assert value(t.argv, "--tp-size") == "2" and value(t.argv, "--port") == str(t.topo.bind_port)
        assert value(t.argv, "--model-path") == "/models/x"
        assert value(t.argv, "--engine-info-bootstrap-port") == str(extra_ports(urls, urls[t.rank])[1])
        assert t.argv[1:3] == ["-m", "sglang.launch_server"] and value(t.argv, "--dist-init-addr") is None
    assert value(router.argv, "--port") == str(base + PORT_ROUTER)
    assert router.argv[router.argv.index("--worker-urls") + 1:][:2] == list(urls)


@pytest.mark.parametrize("overrides, gpus, words", [
    (LOCAL_NODE, 4, ["the roles ask for 6 GPUs", "inference.num_workers(2) x inference.worker.tp(2)",
                     "this machine has 4"]),
    (["inference=sglang_node", "inference.sglang.model_path=/m"], 0, ["inference.worker.tp(1)", "has none"]),
    (["inference=sglang_node", "inference.sglang.model_path=/m"], 1, ["inference.sglang.mem_fraction_static is unset"]),
    (["inference=sglang_pd", "orchestrator.return_routed_experts=false"], 8, ["prefill/decode disaggregation runs on Slurm"]),
])
def test_refused_before_anything_starts(overrides, gpus, words):
    with pytest.raises(PlanError) as e:
        build_plan(compose(overrides), gpus=LocalGPUs(tuple(str(i) for i in range(gpus)), "NVML"))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_one_gpu_shared_with_a_memory_share_set():
    plan = build_plan(compose(["inference=sglang_node", "inference.sglang.model_path=/m",
                               "inference.sglang.mem_fraction_static=0.3"]), gpus=LocalGPUs(("0",), "NVML"))
    assert [(p.role, p.cuda_visible_devices) for p in plan.gpu_placement] == [
        ("trainer", "0"), ("inference", "0"), ("orchestrator", ""), ("router", "")]
