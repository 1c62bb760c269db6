"""The router task of the SGLang backend: config + Topology -> the exact smg command line
(``python -m smg.launch_router ...``), and the exec into it (``python -m workers.router`` asks
this backend's spec, which calls :func:`exec_router`).

Why smg: it is the SGLang Model Gateway, the router SGLang documents for RL rollouts
(docs/advanced_features/sglang_for_rl.md, "Load Balancing Router"); the package was
``sglang-router`` until 0.3.2 and continues as ``smg`` (pinned in setup.cfg [sglang]).
Its CLI is checked in tests/unit/inference/test_sglang_parser.py with smg's own parser
(smg.launch_router.parse_router_args, which also runs its cross-flag validation).

Two modes, from the plan's roles:
  - unified workers: ``--worker-urls URL...`` with ``--policy``;
  - prefill/decode disaggregation: ``--pd-disaggregation --prefill URL BOOTSTRAP_PORT ...
    --decode URL ...`` with ``--prefill-policy`` / ``--decode-policy``; the router adds
    bootstrap host/port/room to each request and sends it to one prefill and one decode.
Sticky routing: the orchestrator sends the episode's routing key in the header named by
``--routing-key-headers``; ``consistent_hashing`` maps one key to one worker, so every turn
of a multi-turn episode lands on the server holding its prefix in the radix cache.
Only generation goes through the router; admin calls (pause, weight updates) go to each
server directly (workers/orchestrator/loop.py; the client side is router_client.py).
smg gets the admin token (``--api-key``, for its calls to the servers) in memory through
keyed.py: smg 1.13.0 reads it from no environment variable or file, and argv is public.
"""
from __future__ import annotations

import os
import sys

from workers.common.config import RunConfig
from workers.common.topology import PORT_ROUTER, PORT_ROUTER_METRICS, Topology
from workers.inference.sglang import keyed
from workers.inference.sglang.ports import extra_ports, url_port

ROUTER_MODULE = "smg.launch_router"


def router_argv(cfg: RunConfig, *, host: str, port: int, inference_urls: tuple[str, ...],
                prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], python: str = "python") -> list[str]:
    """The router's argv (items, not shell-quoted), without the key (keyed.py adds it in memory)."""
    r = cfg.inference.sglang.router
    argv = [python, "-m", ROUTER_MODULE, "--host", host, "--port", str(port)]
    if prefill_urls or decode_urls:
        argv.append("--pd-disaggregation")
        for url in prefill_urls:
            argv += ["--prefill", url, str(extra_ports(inference_urls, url)[0])]
        for url in decode_urls:
            argv += ["--decode", url]
        argv += ["--prefill-policy", r.prefill_policy, "--decode-policy", r.decode_policy]
    else:
        argv += ["--worker-urls", *inference_urls, "--policy", r.policy]
    argv += ["--routing-key-headers", r.routing_key_header]
    argv += ["--request-timeout-secs", str(r.request_timeout_s),
             "--worker-startup-timeout-secs", str(r.worker_startup_timeout_s),
             "--health-check-interval-secs", str(r.health_check_interval_s),
             "--log-level", r.log_level]
    # metrics beside the router, in the job's own port range (smg's default is 0.0.0.0:29000 for every job)
    argv += ["--prometheus-host", host, "--prometheus-port", str(port - PORT_ROUTER + PORT_ROUTER_METRICS)]
    return argv + list(r.extra_args)


def command(cfg: RunConfig, topo: Topology, *, python: str = sys.executable) -> list[str]:
    if topo.router_url is None:
        raise RuntimeError("router: the topology has no router URL (SLURMRL_LAYOUT lists no router role)")
    return router_argv(cfg, host=topo.bind_host, port=url_port(topo.router_url),
                       inference_urls=topo.inference_urls, prefill_urls=topo.prefill_urls,
                       decode_urls=topo.decode_urls, python=python)


def exec_router(cfg: RunConfig, topo: Topology, *, key_file: str) -> None:
    """Replace this process by smg (never returns); ``key_file``: run_dir/admin_token."""
    argv = keyed.wrap(command(cfg, topo))
    env = {**os.environ, keyed.KEY_FILE_ENV: key_file}
    print(f"[router] exec {' '.join(argv)} (--api-key from {key_file}, in memory)", flush=True)
    os.execvpe(argv[0], argv, env)


def preview(cfg: RunConfig) -> list[str]:
    """Router argv with placeholder hosts for the sbatch comments (hosts are known at run time)."""
    inf = cfg.inference
    pd = inf.num_prefill_replicas > 0
    n_p, n_d = (inf.num_prefill_replicas, inf.num_decode_replicas) if pd else (0, 0)
    n = n_p + n_d if pd else inf.num_workers
    urls = tuple(f"http://<server{i}>:{8 + 2 * i}" for i in range(n))  # offsets from the job's first port
    argv = router_argv(cfg, host="<node>", port=1, inference_urls=urls, prefill_urls=urls[:n_p],
                       decode_urls=urls[n_p:] if pd else ())
    return keyed.wrap(argv)
