"""Test-only inference backend ``fake_embedded_cli``: the embedded engine, launched through a command of its own.

It shows that a backend is one module registering a BackendSpec (workers/inference/spec.py), with
no project file edited: importing this module registers it (``SLURMRL_PLUGINS=tests.plugins.backends_plugin``
or the run config's ``plugins:``), and every role imports it again before loading the config.

- config: :class:`FakeEmbeddedCliConfig`, the embedded schema plus ``greeting`` (Hydra option
  ``inference=fake_embedded_cli``, stored from the dataclass since there is no YAML);
- plan check: an empty greeting is refused, naming ``inference.greeting``;
- launch: ``serve`` execs ``python -m tests.plugins.backends_plugin --greeting <greeting>`` (as SGLang's
  spec execs ``sglang.launch_server``); that entry runs the embedded server, logs the greeting and
  reports it (and the backend's name) in /get_model_info.

    SLURMRL_PLUGINS=tests.plugins.backends_plugin python -m launcher inference=fake_embedded_cli
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from workers.inference.embedded.config import EmbeddedInferenceConfig
from workers.inference.spec import BackendConfigError, BackendSpec, register

NAME = "fake_embedded_cli"
ENTRY = "tests.plugins.backends_plugin"


@dataclasses.dataclass(kw_only=True)
class FakeEmbeddedCliConfig(EmbeddedInferenceConfig):
    """The embedded engine's options plus one of this backend's own."""

    backend: str = NAME
    """``fake_embedded_cli``: this schema's backend."""
    greeting: str = "hello from fake_embedded_cli"
    """Passed on the server's command line; logged at start and reported by /get_model_info."""


def check(cfg) -> None:
    if not cfg.inference.greeting.strip():
        raise BackendConfigError("inference.greeting is empty: the fake_embedded_cli server needs something to say")


def command(cfg) -> list[str]:
    """The server task's own command line."""
    return [sys.executable, "-m", ENTRY, "--greeting", cfg.inference.greeting]


def serve(cfg, topology) -> int:
    """Replace ``python -m workers.inference`` by this backend's own entry (never returns)."""
    argv = command(cfg)
    print(f"[{topology.role}[{topology.rank}]] exec {' '.join(argv)}", flush=True)
    os.execv(argv[0], argv)
    return 1  # not reached


def main(argv: list[str]) -> int:
    """The entry ``serve`` execs: the embedded server with this backend's greeting."""
    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY}")
    parser.add_argument("--greeting", required=True)
    args = parser.parse_args(argv)
    import torch

    from workers.common.config import load_run_config
    from workers.common.logs import get_logger
    from workers.common.protocol import RunPaths
    from workers.common.topology import current_topology
    from workers.inference.embedded.server import run_server

    topology = current_topology()
    cfg = load_run_config(str(RunPaths(topology.run_dir).run_config))  # imports this module as a plugin
    if cfg.inference.backend != NAME:
        raise SystemExit(f"{ENTRY}: inference.backend={cfg.inference.backend!r}, expected {NAME!r}")
    torch.set_num_threads(cfg.inference.num_threads)
    get_logger("inference", topology.rank, all_ranks=True).info("%s says %r", NAME, args.greeting)
    return run_server(cfg, topology, extra_info={"backend": NAME, "greeting": args.greeting})


if __name__ == "__main__":  # the server entry; the registering copy is the imported module
    sys.exit(main(sys.argv[1:]))
else:
    SPEC = register(BackendSpec(name=NAME, config=FakeEmbeddedCliConfig, check=check, serve=serve,
                                serves_api_of=("embedded",), summary="test only: the embedded engine started through its own command"))
