"""launcher/standalone.py (``slurmrl submit``) and the status watcher, without Slurm: argument
checks, the submitit parameters a profile gives, per-node output dirs, and submitit's sacct
watcher reading our hetjobs' ``L+K`` rows (the cluster side: tests/slurm/test_standalone_submitit.py)."""
from __future__ import annotations

import sys

import pytest

from launcher.runs_list import HetjobWatcher
from launcher.standalone import Task, executor_parameters, parse, profile_options

SACCT = """JobID|State|Reason|NodeList
449+0|COMPLETED|None|node1
449+0.batch|COMPLETED||node1
449+1|COMPLETED|None|node[2-3]
449+1.0|CANCELLED by 0||node[2-3]
460+0|PENDING|Resources|None assigned
460+1|PENDING|Resources|None assigned
471|FAILED|None|node2
"""


def test_watcher_maps_hetjob_parts_to_the_leader():
    info = HetjobWatcher(delay_s=0).read_info(SACCT)
    assert info["449"]["State"] == "COMPLETED" and info["460"]["Reason"] == "Resources"
    assert info["471"]["State"] == "FAILED" and "449+1.0" not in info


def test_watcher_asks_sacct_for_the_reason_in_one_call():
    w = HetjobWatcher(delay_s=0)
    for j in ("1", "2"):
        w.register_job(j)
    cmd = w._make_command()
    assert cmd[:3] == ["sacct", "-o", "JobID,State,Reason,NodeList"] and sorted(cmd[-3::2]) == ["1", "2"]


def test_parse_rules():
    a, rest = parse(["preflight", "--nodes", "3", "--", "--out", "d"])
    assert a.nodes == 3 and rest == ["--out", "d"]
    for argv, msg in ((["export", "--nodes", "2", "--", "a", "b"], "export runs on one node"),
                      (["eval"], "eval needs its arguments after --"), (["bogus", "--", "x"], "invalid choice")):
        with pytest.raises(SystemExit):
            parse(argv)


def test_profile_and_flags_make_the_executor_parameters():
    prof = profile_options("local_slurm")
    assert prof["partition"] == "debug" and prof["num_cpus_per_node"] == 4
    a, _ = parse(["preflight", "--nodes", "2", "--mem", "0", "--", "--out", "d"])
    p = executor_parameters(a, prof)
    assert {k: p[k] for k in ("nodes", "ntasks_per_node", "cpus_per_task", "partition", "mem", "time")} == {
        "nodes": 2, "ntasks_per_node": 1, "cpus_per_task": 4, "partition": "debug", "mem": "0", "time": 60}
    assert "gpus_per_node" not in p and p["setup"][-1].startswith("export PYTHONPATH=")
    with pytest.raises(SystemExit, match="no cluster profile 'nope'"):
        profile_options("nope")
    with pytest.raises(SystemExit, match="backend=local, not slurm"):
        profile_options("local")


def test_preflight_tasks_write_one_dir_per_node():
    t = Task(module="workers.preflight", args=("standalone", "--out", "/x/pre", "max_bytes=1"), per_node_out=True)
    assert t.argv("node7") == [sys.executable, "-m", "workers.preflight", "standalone", "--out", "/x/pre/node7",
                               "max_bytes=1"]
    assert Task(module="m", args=("--out", "o")).argv("n")[-1] == "o"


def test_failing_task_raises_with_its_output(tmp_path):
    t = Task(module="workers.weights.filesystem.resolve", args=(str(tmp_path / "missing"), str(tmp_path / "o")))
    with pytest.raises(RuntimeError, match="exited with 2"):
        t()
