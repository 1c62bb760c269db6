"""Every generated command line goes through the pinned versions' own parsers.

SGLang 0.5.23 (``pip install --no-deps sglang==0.5.23`` + the few modules its argument code
imports: ``make install-sglang``) parses each server task's argv with
``ServerArgs.add_cli_args`` and builds ``ServerArgs.from_cli_args`` from it: an unknown flag,
a value outside a flag's choices or of the wrong type fails here. smg 1.13.0 (the router)
parses the router argv with ``smg.launch_router.parse_router_args``, which also runs its
cross-flag validation. The admin token is never on the generated argv: each case gets
``--api-key`` appended the way keyed.py does it in memory, and the parsers must read it back.
Both run in one subprocess (importing sglang takes seconds and
patches libraries: keep it out of the test process).

If these fail with "No module named sglang" or "smg", the venv lacks the pinned packages:
run ``make install-sglang`` (``make test`` depends on it; see the Makefile for the list).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.inference.sglang_cases import API_KEY, PRESETS, local_tasks, router_task, server_tasks
from workers.inference.sglang import keyed
from workers.weights.sglang.wire import DELTA_LOADER

REPO = Path(__file__).resolve().parents[3]
SCRIPT = r"""
import argparse, json, sys

class Refuse(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

cases = json.load(sys.stdin)
out = {"server": {}, "router": {}}
from sglang.srt.server_args import ServerArgs
import sglang
out["sglang_version"] = sglang.__version__
for name, argv in cases["server"].items():
    parser = Refuse(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(argv)
        args = ServerArgs.from_cli_args(ns)
        out["server"][name] = {"unknown": unknown, "tp_size": args.tp_size, "port": args.port, "api_key": args.api_key,
                                  "custom_weight_loader": args.custom_weight_loader,
                                  "lora": [args.enable_lora, args.max_lora_rank, args.lora_target_modules,
                                           args.max_loras_per_batch]}
    except Exception as e:
        out["server"][name] = {"error": f"{type(e).__name__}: {e}"}
from smg.launch_router import parse_router_args
from importlib.metadata import version
out["smg_version"] = version("smg")  # smg/version.py still says 1.1.0; the distribution's own is authoritative
for name, argv in cases["router"].items():
    try:
        a = parse_router_args(argv)
        out["router"][name] = {"pd": a.pd_disaggregation, "prefill": a.prefill_urls, "decode": a.decode_urls,
                               "workers": a.worker_urls, "headers": a.routing_key_headers, "api_key": a.api_key}
    except BaseException as e:
        out["router"][name] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed():
    cases = {"server": {}, "router": {}}
    for name in PRESETS:
        for t in server_tasks(name):
            cases["server"][f"{name}/{t.role}[{t.rank}]"] = keyed.with_key(t.argv[3:], API_KEY)
        cases["router"][name] = keyed.with_key(router_task(name).argv[3:], API_KEY)
    servers, router = local_tasks()  # one GPU node without Slurm: local processes, the same parsers
    for t in servers:
        cases["server"][f"local_node/{t.role}[{t.rank}]"] = keyed.with_key(t.argv[3:], API_KEY)
    cases["router"]["local_node"] = keyed.with_key(router.argv[3:], API_KEY)
    good = cases["server"]["kimi_k2_swe_32xh200/inference[0]"]  # the parser must catch these (a control)
    cases["server"]["control/unknown"] = good + ["--enable-dp-attentionn"]
    cases["server"]["control/choice"] = good + ["--deepep-mode", "fast"]
    cases["router"]["control/policy"] = ["--worker-urls", "http://h:1", "--policy", "sticky_by_luck"]
    res = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, (f"the SGLang/smg parser run failed (run `make install-sglang` if a module is "
                                 f"missing):\n{res.stderr[-3000:]}")
    return cases, json.loads(res.stdout.strip().splitlines()[-1])


def test_pinned_versions_are_the_ones_parsing(parsed):
    _, out = parsed
    assert out["sglang_version"] == "0.5.23" and out["smg_version"] == "1.13.0"


def test_every_server_argv_parses_with_sglangs_own_parser(parsed):
    cases, out = parsed
    assert len(cases["server"]) >= 30  # every task of every SGLang preset
    bad = {name: r for name, r in out["server"].items() if "error" in r or r["unknown"]}
    assert bad.pop("control/unknown")["unknown"] == ["--enable-dp-attentionn"]
    assert "invalid choice: 'fast'" in bad.pop("control/choice")["error"]
    assert not bad, f"SGLang 0.5.23 refuses these command lines: {json.dumps(bad, indent=1)[:4000]}"
    for name, argv in cases["server"].items():
        if name.startswith("control/"):
            continue
        assert out["server"][name]["tp_size"] == int(argv[argv.index("--tp-size") + 1])
        assert out["server"][name]["port"] == int(argv[argv.index("--port") + 1])
        # weights.delta (the GLM-5 and Kimi K2 presets): SGLang's parser reads our patch loader's import path
        want = [DELTA_LOADER] if "--custom-weight-loader" in argv else []
        assert (out["server"][name]["custom_weight_loader"] or []) == want, name
    assert any(r.get("custom_weight_loader") for n, r in out["server"].items() if n.startswith("glm5_swe_28xh200/"))


def test_lora_mode_servers_parse_with_lora_enabled(parsed):
    """trainer.lora.rank > 0: SGLang reads LoRA on, the rank, the modules (experts as gate_up_proj/down_proj,
    peft's target_parameters layout) and room for the adapter being replaced beside the new one; off otherwise."""
    _, out = parsed
    lora = {n: r["lora"] for n, r in out["server"].items() if n.startswith("inference_sglang_lora/")}
    assert lora and all(v[0] is True and v[1] == 16 and v[3] == 3 for v in lora.values()), lora
    assert all({"q_proj", "o_proj", "gate_up_proj", "down_proj"} <= set(v[2]) for v in lora.values()), lora
    plain = out["server"]["inference_sglang/inference[0]"]["lora"]
    assert not plain[0] and plain[1] is None
    # several adapters (trainer.lora.adapters=[short,long]): room for both versions of each, plus the base
    several = {n: r["lora"] for n, r in out["server"].items() if n.startswith("inference_sglang_adapters/")}
    assert several and all(v[0] is True and v[3] == 5 and {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(v[2])
                           and "gate_up_proj" not in v[2] for v in several.values()), several


def test_every_router_argv_parses_with_smgs_own_parser(parsed):
    cases, out = parsed
    bad = {name: r for name, r in out["router"].items() if "error" in r}
    assert bad.pop("control/policy")["error"] == "SystemExit: 2"  # argparse: invalid choice
    assert not bad, f"smg 1.13.0 refuses these router command lines: {bad}"
    glm5 = out["router"]["glm5_swe_28xh200"]
    assert glm5["pd"] and len(glm5["prefill"]) == 2 and len(glm5["decode"]) == 2
    assert all(isinstance(port, int) for _, port in glm5["prefill"]) and glm5["headers"] == ["x-smg-routing-key"]
    kimi = out["router"]["kimi_k2_swe_32xh200"]
    assert not kimi["pd"] and len(kimi["workers"]) == 2
    local = out["router"]["local_node"]
    assert not local["pd"] and local["workers"] == [t.topo.inference_urls[t.rank] for t in local_tasks()[0]]


def test_the_token_reaches_both_parsers_but_no_generated_argv(parsed):
    cases, out = parsed
    for kind in ("server", "router"):
        for name, r in out[kind].items():
            if not name.startswith("control/"):
                assert r["api_key"] == API_KEY, (kind, name, r)
    for name in PRESETS:
        for argv in [*(t.argv for t in server_tasks(name)), router_task(name).argv]:
            assert API_KEY not in argv and "--api-key" not in argv, argv
