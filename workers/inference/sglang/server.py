"""SGLang server tasks: where this task sits, its command line, and the exec into SGLang.

How it is run: the Slurm step of a server role runs ``python -m workers.inference`` on
every task; with ``inference.backend=sglang`` that entry asks this backend's spec to serve
(spec.py), which calls :func:`exec_server`: it replaces the process by
``python -m sglang.launch_server`` with the argv of args.py. One task per node of a replica: the head (node rank 0)
serves HTTP; the others join through --dist-init-addr (the head's dist-init port) and
--node-rank, all derived from workers/common/topology.py, never from bash.

Protocol with the orchestrator (who waits for whom): the orchestrator polls
``/health_generate`` on every head until each passes or ``inference.startup_timeout_s``
ends, then names the servers that are not ready (inference_client.wait_until_ready).
Weight updates go to every head directly: pause_generation -> update_weights_from_disk
(or _from_distributed) -> continue_generation; generation goes through the router.
Why exec and not a child process: Slurm's signals (SIGTERM at shutdown, the time-limit
warning) then reach SGLang itself, which shuts its scheduler processes down. The exec goes
through keyed.py, which adds ``--api-key`` from run_dir/admin_token in memory: the token is
never on a command line (``ps`` shows every user every argv).
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

from workers.common.config import RunConfig
from workers.common.topology import Topology
from workers.inference.sglang import keyed
from workers.inference.sglang.args import Placement, role_layout, server_argv, server_env
from workers.inference.sglang.ports import extra_ports


def role_urls(topo: Topology, role: str) -> tuple[str, ...]:
    """Head URLs of the replicas of ``role`` (prefill and decode are slices of inference_urls)."""
    return {"prefill": topo.prefill_urls, "decode": topo.decode_urls}.get(role, topo.inference_urls)


def placement(cfg: RunConfig, topo: Topology) -> Placement:
    """This task's place in its replica, from the Topology (the only reader of the Slurm env)."""
    role = topo.role
    urls = role_urls(topo, role)
    if topo.replica >= len(urls):
        raise RuntimeError(f"{role}[{topo.rank}] is replica {topo.replica} but the job has {len(urls)} {role} "
                           f"server(s): {list(urls)}")
    url = urls[topo.replica]
    port = int(url.rsplit(":", 1)[1])
    bootstrap, engine_info = extra_ports(topo.inference_urls, url)
    lay = role_layout(cfg.inference, role)
    num_nodes = topo.num_nodes_per_replica
    if num_nodes != lay.num_nodes_per_replica:
        raise RuntimeError(f"{role}: SLURMRL_LAYOUT says {num_nodes} node(s) per replica, the config "
                           f"{lay.num_nodes_per_replica} (was the run config edited after rendering?)")
    # DP attention talks over ZMQ TCP ports derived from --dist-init-addr even on one node;
    # without it SGLang would use --port + 233.., outside the job's port range.
    needs_rendezvous = num_nodes > 1 or lay.dp_attention > 1
    if needs_rendezvous and topo.dist_init_addr is None:
        raise RuntimeError(f"{role}[{topo.rank}]: a replica of {num_nodes} node(s) with dp_attention "
                           f"{lay.dp_attention} needs a dist-init address; the topology has none")
    return Placement(role=role, replica=topo.replica, node_rank=topo.node_rank, num_nodes=num_nodes,
                     host=topo.bind_host, port=port,
                     dist_init_addr=topo.dist_init_addr if needs_rendezvous else None,
                     bootstrap_port=bootstrap, engine_info_port=engine_info)


def command(cfg: RunConfig, topo: Topology, *, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(SGLang's argv without the key, extra environment) of this server task."""
    if not cfg.inference.sglang.model_path:
        raise RuntimeError("inference.sglang.model_path is empty: SGLang needs the initial checkpoint")
    p = placement(cfg, topo)
    return server_argv(cfg, p, python=python), server_env(cfg, topo.role)


def exec_server(cfg: RunConfig, topo: Topology, *, key_file: str,
                environ: Optional[Mapping[str, str]] = None) -> None:
    """Replace this process by the SGLang server (never returns); ``key_file``: run_dir/admin_token."""
    sglang_argv, extra = command(cfg, topo)
    argv = keyed.wrap(sglang_argv)
    env = dict(os.environ if environ is None else environ)
    env.update(extra)
    env[keyed.KEY_FILE_ENV] = key_file
    print(f"[{topo.role}[{topo.rank}]] exec {' '.join(argv)} (--api-key from {key_file}, in memory)", flush=True)
    os.execvpe(argv[0], argv, env)


def preview(cfg: RunConfig, role: str) -> list[str]:
    """The argv of replica 0's head of ``role`` with placeholders for what only Slurm knows.

    Rendered as comments into the sbatch script (and the golden files), so a reviewer sees
    the exact flags without a cluster; hosts and ports are filled in at run time.
    """
    lay = role_layout(cfg.inference, role)
    rendezvous = lay.num_nodes_per_replica > 1 or lay.dp_attention > 1
    p = Placement(role=role, replica=0, node_rank=0, num_nodes=lay.num_nodes_per_replica, host="<node>",
                  port=0, dist_init_addr="<head>:<dist_port>" if rendezvous else None, bootstrap_port=0,
                  engine_info_port=0)
    return keyed.wrap(_placeholders(server_argv(cfg, p, python="python")))


def _placeholders(argv: list[str]) -> list[str]:
    names = {"--port": "<http_port>", "--disaggregation-bootstrap-port": "<bootstrap_port>",
             "--engine-info-bootstrap-port": "<engine_info_port>"}
    return [names.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
