"""SGLang and router command lines from config + topology (workers/inference/sglang*.py,
workers/inference/sglang/router.py): placement flags per task, ports inside the job's range and never
shared on one host, the router agreeing with the servers on every port, per-role features
and environment, and the exec that keeps the admin token off every command line (keyed.py adds it in memory)."""
from __future__ import annotations

from collections import defaultdict

import pytest

from tests.unit.inference.sglang_cases import PRESETS, build, job_ports, router_task, server_tasks, value
from workers.inference.sglang import server as sglang_server


@pytest.fixture(scope="module")
def glm5():
    return server_tasks("glm5_swe_28xh200")


def test_glm5_every_task_has_its_replica_placement(glm5):
    by_role = defaultdict(list)
    for t in glm5:
        by_role[t.role].append(t)
    assert [len(by_role[r]) for r in ("prefill", "decode")] == [4, 8]  # 2 x 2 nodes, 2 x 4 nodes
    for role, nodes in (("prefill", 2), ("decode", 4)):
        for t in by_role[role]:
            a = t.argv
            assert a[:3] == ["python", "-m", "sglang.launch_server"]
            assert value(a, "--nnodes") == str(nodes) and value(a, "--node-rank") == str(t.rank % nodes)
            head = by_role[role][t.rank - t.rank % nodes]
            assert value(a, "--dist-init-addr") == value(head.argv, "--dist-init-addr")  # one rendezvous per replica
            assert value(a, "--dist-init-addr").split(":")[0] == head.topo.bind_host
            assert value(a, "--host") == t.topo.bind_host and value(a, "--disaggregation-mode") == role
            assert "--api-key" not in a and value(a, "--tp-size") == str(8 * nodes)
    p, d = by_role["prefill"][0].argv, by_role["decode"][0].argv
    assert value(p, "--deepep-mode") == "normal" and value(d, "--deepep-mode") == "low_latency"
    assert value(p, "--enable-hierarchical-cache") is True and value(p, "--hicache-storage-backend") == "file"
    assert value(d, "--enable-eplb") is True and value(d, "--ep-num-redundant-experts") == "32"
    assert value(d, "--disaggregation-bootstrap-port") is None and value(p, "--disaggregation-bootstrap-port")
    # R3 through PD: both sides report routing, the orchestrator merges it (pd_client.py)
    assert value(p, "--enable-return-routed-experts") is True and value(d, "--enable-return-routed-experts") is True


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_ports_are_in_the_job_range_and_unique_per_host(name):
    span = job_ports(name)
    used: dict[tuple[str, int], str] = {}
    for t in server_tasks(name):
        if t.topo.node_rank:  # only replica heads listen on these ports
            continue
        ports = [int(value(t.argv, f)) for f in ("--port", "--engine-info-bootstrap-port")]
        if value(t.argv, "--disaggregation-bootstrap-port"):
            ports.append(int(value(t.argv, "--disaggregation-bootstrap-port")))
        if value(t.argv, "--dist-init-addr"):
            dist = int(value(t.argv, "--dist-init-addr").rsplit(":", 1)[1])
            ports += list(range(dist, dist + 7))  # SGLang's derived ZMQ ports (server_args.py PortArgs)
        for port in ports:
            assert port in span, f"{t.role}[{t.rank}] port {port} outside the job's range {span}"
            key = (t.topo.bind_host, port)
            assert key not in used, f"{t.role}[{t.rank}] and {used[key]} both use {key}"
            used[key] = f"{t.role}[{t.rank}]"
    router = router_task(name)  # the router and its metrics too (smg's default 0.0.0.0:29000 collides between jobs)
    assert value(router.argv, "--prometheus-host") == router.topo.bind_host
    for port in (int(value(router.argv, "--port")), int(value(router.argv, "--prometheus-port"))):
        assert port in span, f"router port {port} outside the job's range {span}"
        key = (router.topo.bind_host, port)
        assert key not in used, f"router and {used.get(key)} both use {key}"
        used[key] = "router"


@pytest.mark.parametrize("name", ["glm5_swe_28xh200", "nemotron3_ultra_pd_20xh200", "inference_sglang_pd"])
def test_pd_router_names_every_server_with_its_bootstrap_port(name):
    heads = {(t.role, t.topo.replica): t for t in server_tasks(name) if t.topo.node_rank == 0}
    r = router_task(name).argv
    assert r[:3] == ["python", "-m", "smg.launch_router"] and "--pd-disaggregation" in r
    prefill = [(r[i + 1], r[i + 2]) for i, a in enumerate(r) if a == "--prefill"]
    decode = [r[i + 1] for i, a in enumerate(r) if a == "--decode"]
    want_p = [(f"http://{h.topo.bind_host}:{value(h.argv, '--port')}", value(h.argv, "--disaggregation-bootstrap-port"))
              for (role, _), h in sorted(heads.items()) if role == "prefill"]
    want_d = [f"http://{h.topo.bind_host}:{value(h.argv, '--port')}" for (role, _), h in sorted(heads.items())
              if role == "decode"]
    assert prefill == want_p and decode == want_d
    assert value(r, "--prefill-policy") == "consistent_hashing" and value(r, "--routing-key-headers") == "x-smg-routing-key"
    assert value(r, "--port") == router_task(name).topo.router_url.rsplit(":", 1)[1]


def test_unified_router_and_routed_experts_for_kimi():
    tasks = server_tasks("kimi_k2_swe_32xh200")
    head = tasks[0].argv
    for flag in ("--enable-return-routed-experts", "--skip-tokenizer-init", "--trust-remote-code", "--enable-eplb",
                 "--enable-dp-lm-head", "--enable-hierarchical-cache"):
        assert value(head, flag) is True, flag
    assert value(head, "--fp8-gemm-backend") == "deep_gemm" and value(head, "--moe-runner-backend") == "deep_gemm"
    assert value(head, "--moe-a2a-backend") == "deepep" and value(head, "--deepep-mode") is None  # auto: SGLang's default
    assert value(head, "--attn-dp-size") == "32" and value(head, "--weight-version") == "0"
    r = router_task("kimi_k2_swe_32xh200").argv
    assert "--pd-disaggregation" not in r and value(r, "--policy") == "consistent_hashing"
    assert r[r.index("--worker-urls") + 1:r.index("--policy")] == list(tasks[0].topo.inference_urls)


def test_step_environment_per_role(glm5):
    env = {t.role: t.env for t in glm5}
    assert env["prefill"]["NVSHMEM_IB_ENABLE_IBGDA"] == "1" and env["decode"]["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK" not in env["prefill"]  # normal mode: no LL buffers
    assert env["decode"]["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] == "128"  # covers the CUDA graph batch
    assert env["prefill"]["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == "/local_nvme/slurmrl-hicache"
    assert all(e["NCCL_CUMEM_ENABLE"] == "1" for e in env.values())
    nemotron = {t.role: t.env for t in server_tasks("nemotron3_ultra_pd_20xh200")}
    assert not any(k.startswith("NVSHMEM") for e in nemotron.values() for k in e)  # no DeepEP there


def test_features_name_what_each_role_turns_on():
    _, plan = build("glm5_swe_28xh200")
    feats = {s.role: s.features for s in plan.backend_steps}
    assert "deepep normal" in feats["prefill"] and "CUDA graphs off" in feats["prefill"]
    assert "deepep low_latency" in feats["decode"] and "EPLB +32 redundant" in feats["decode"]
    assert feats["router"] == ("smg PD", "consistent_hashing")
    assert any(line.startswith("sglang decode: PD decode") for line in plan.summary())


def test_exec_replaces_the_process_and_hides_the_token(monkeypatch, capsys):
    cfg, plan = build("kimi_k2_swe_32xh200")
    task = server_tasks("kimi_k2_swe_32xh200")[1]  # node rank 1 of replica 0
    seen = {}
    monkeypatch.setattr(sglang_server.os, "execvpe", lambda f, argv, env: seen.update(f=f, argv=argv, env=env))
    sglang_server.exec_server(cfg, task.topo, key_file="/run/admin_token", environ={"PATH": "/bin"})
    assert seen["argv"][1:4] == ["-m", "workers.inference.sglang.keyed", "sglang.launch_server"]
    assert value(seen["argv"], "--node-rank") == "1" and "--api-key" not in seen["argv"]
    assert seen["env"]["PATH"] == "/bin" and seen["env"]["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert seen["env"]["SLURMRL_API_KEY_FILE"] == "/run/admin_token"
    assert "--api-key from /run/admin_token, in memory" in capsys.readouterr().out


def test_placement_refuses_a_topology_that_disagrees_with_the_config():
    cfg, _ = build("glm5_swe_28xh200")
    task = server_tasks("glm5_swe_28xh200")[0]
    cfg.inference.prefill.num_nodes_per_replica = 4
    with pytest.raises(RuntimeError, match="SLURMRL_LAYOUT says 2 node"):
        sglang_server.placement(cfg, task.topo)
    cfg, _ = build("glm5_swe_28xh200")
    cfg.inference.sglang.model_path = ""
    with pytest.raises(RuntimeError, match="model_path is empty"):
        sglang_server.command(cfg, task.topo)
