"""The extra ports an SGLang server uses, inside the job's port range (after topology's).

Why: topology.py gives server i its HTTP port (base+8+2i) and its dist-init port (+1).
SGLang needs more on the replica's head node: with DP attention or several nodes it
derives six ZMQ ports right above --dist-init-addr's port (server_args.py PortArgs:
port_base = dist_init_port + 1 .. +6), a prefill server runs a KV-transfer bootstrap
server (--disaggregation-bootstrap-port, default 8998) and every server an engine-info
server (--engine-info-bootstrap-port, default 6789, "must be set explicitly when running
multiple instances on the same node"). Fixed defaults collide between replicas sharing a
node and between jobs, so each server gets its own pair in a block that starts past every
topology port plus the derived ZMQ ones:

    server i of N:  bootstrap = base + 16 + 2N + 2i,   engine info = bootstrap + 1

The server (server.py) and the router (router.py) of this package both compute it
from the server's HTTP URL, so they always agree; the plan checks the range holds it.
"""
from __future__ import annotations

from workers.common.topology import PORT_SERVERS

DERIVED_ZMQ_PORTS = 6
"""Ports SGLang derives above the dist-init port (server_args.py PortArgs.init_new)."""
EXTRA_BLOCK_OFFSET = PORT_SERVERS + 2 + DERIVED_ZMQ_PORTS
"""16: the extra block starts past server i's own dist-init + derived ports (base+9+2i+6 < base+16+2i)."""


def ports_needed(num_servers: int) -> int:
    """Ports of the job's range an SGLang job of ``num_servers`` servers uses."""
    return EXTRA_BLOCK_OFFSET + 4 * num_servers


def url_port(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


def server_index(inference_urls: tuple[str, ...], url: str) -> int:
    """Global server number of the replica whose head serves ``url`` (topology order)."""
    if url not in inference_urls:
        raise RuntimeError(f"{url} is not one of the job's inference servers {list(inference_urls)}")
    return inference_urls.index(url)


def extra_ports(inference_urls: tuple[str, ...], url: str) -> tuple[int, int]:
    """(KV bootstrap port, engine-info port) of the server whose HTTP URL is ``url``."""
    i, n = server_index(inference_urls, url), len(inference_urls)
    base = url_port(url) - PORT_SERVERS - 2 * i
    bootstrap = base + EXTRA_BLOCK_OFFSET + 2 * n + 2 * i
    return bootstrap, bootstrap + 1
