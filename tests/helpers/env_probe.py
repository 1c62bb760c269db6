"""``python -m tests.helpers.env_probe``: a stand-in role process that records what the launcher gave it.

The local backend starts it in place of a role's module (tests/unit/launcher/test_local_gpu_placement.py):
it writes its GPU environment and its topology (workers/common/topology.py, as every role reads
it) to ``$SLURMRL_RUN_DIR/probe_<role>_<rank>.json`` and exits 0, so a test checks the environment
real child processes get without starting torch or a model. With ``SLURMRL_PROBE_EXPECT=N`` the main
roles (every role but inference) wait, up to a minute, until N probes are written before exiting: the
run ends when they exit and the servers are then stopped, so on a loaded machine a server still
starting would be stopped before it wrote its probe.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from workers.common.topology import current_topology


def main() -> None:
    topo = current_topology()
    record = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
              "topology": dataclasses.asdict(topo)}
    out = Path(topo.run_dir) / f"probe_{topo.role}_{topo.rank}.json"
    out.write_text(json.dumps(record))
    expect = int(os.environ.get("SLURMRL_PROBE_EXPECT", "0"))
    deadline = time.monotonic() + 60.0
    while topo.role != "inference" and time.monotonic() < deadline and len(list(out.parent.glob("probe_*.json"))) < expect:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
