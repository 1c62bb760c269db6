"""Issue 47 item 6: paths and names a user gets wrong are refused at plan time, naming the key.

Unreadable inputs (``env.path`` / ``env.eval_path`` files and directories, a run to resume) used to end
in PermissionError tracebacks; ``cluster.runs_root=/`` and a non-empty directory that is not a run were
written into; ``inference.host=::1`` passed the plan and crashed the roles; newlines in names reached
the sbatch header; a bad ``model.path`` file was named but not the key. "Unreadable" for root: the
command runs without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (``setpriv --bounding-set``), so mode 000
holds for it as for any user; a non-root user needs nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.host_checks import HostCheckError, check_bind_host, check_run_target
from tests.helpers.configs import REPO, compose
from workers.common.config.ranges import ConfigError, check_fields
from workers.orchestrator.envs.data import load_records

DROP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def _unprivileged(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    assert shutil.which("setpriv"), "root needs setpriv (util-linux) to test unreadable paths"
    return DROP + cmd


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_unprivileged([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path / 'runs'}",
                                         *args, "launcher.dry_run=true"]),
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def _unreadable(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)
    files = {"file": tmp_path / "locked.jsonl", "dir": tmp_path / "locked_dir", "run": tmp_path / "locked_run"}
    files["file"].write_text(good.read_text())
    files["dir"].mkdir()
    shutil.copy(good, files["dir"] / "a.jsonl")
    (files["run"] / "config").mkdir(parents=True)
    (files["run"] / "config" / "run.yaml").write_text("seed: 1\n")
    for p in (files["file"], files["dir"], files["run"] / "config" / "run.yaml"):
        os.chmod(p, 0)
    files["good"] = good
    return files


def test_unreadable_data_and_runs_are_one_line_errors_naming_the_key(tmp_path):
    f = _unreadable(tmp_path)
    data = ["env=dataset", "model.vocab_size=264", "model.max_position_embeddings=128", "env.max_new_tokens=8"]
    for args, key in [([*data, f"env.path={f['file']}"], "env.path"), ([*data, f"env.path={f['dir']}"], "env.path"),
                      ([*data, f"env.path={f['good']}", f"env.eval_path={f['file']}"], "env.eval_path"),
                      ([f"launcher.resume={f['run']}"], "launcher.resume")]:
        res = _cli(args, tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr[-2000:])
        line = res.stderr.strip().splitlines()[-1]
        assert key in line and "cannot be read: Permission denied" in line, (args, res.stderr[-2000:])
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_directory_where_a_data_file_is_expected_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "shard.jsonl").mkdir()  # a directory named like a data file
    with pytest.raises(ValueError, match=r"env.eval_path=.*is a directory without .jsonl or .parquet files"):
        load_records(str(tmp_path / "d"), key="env.eval_path")
    (tmp_path / "bin.jsonl").write_bytes(b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match="env.path=.*is not UTF-8"):
        load_records(str(tmp_path / "bin.jsonl"))


def test_the_filesystem_root_and_foreign_directories_are_never_run_dirs(tmp_path):
    with pytest.raises(HostCheckError, match="cluster.runs_root='/' is the filesystem root"):
        check_run_target("cluster.runs_root", Path("/new-run"), "/", resume=False)
    with pytest.raises(HostCheckError, match="launcher.run_dir='/' is a non-empty directory that is not a run"):
        check_run_target("launcher.run_dir", Path("/"), str(tmp_path), resume=False)
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(HostCheckError, match="non-empty directory that is not a run"):
        check_run_target("launcher.run_dir", tmp_path, str(tmp_path), resume=False)
    check_run_target("launcher.run_dir", tmp_path / "new", str(tmp_path), resume=False)  # new: fine
    (tmp_path / "empty").mkdir()
    check_run_target("launcher.run_dir", tmp_path / "empty", str(tmp_path), resume=False)  # empty: fine
    res = _cli(["cluster.runs_root=/"], tmp_path)  # end to end: runs/latest would land in / too
    assert res.returncode == 2 and "cluster.runs_root='/'" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_ipv6_hosts_and_multi_line_names_are_refused_at_plan_time():
    for host in ("::1", "fe80::1"):
        with pytest.raises(HostCheckError, match=f"inference.host='{host}' is an IPv6 address"):
            check_bind_host("inference.host", host)
    check_bind_host("inference.host", "127.0.0.1")
    cfg = compose([])
    for section, key in [("launcher", "job_name"), ("cluster", "partition"), ("cluster", "qos"),
                         ("cluster", "account")]:
        obj = getattr(cfg, section)
        bad = dataclasses.replace(obj, **{key: "gpu\n#SBATCH --x"})
        with pytest.raises(ConfigError, match=f"{section}.{key}=.* must be one line of text"):
            check_fields(bad, section)


def test_a_bad_model_path_file_is_refused_naming_model_path(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{not json")
    res = _cli([f"model.path={ckpt}"], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith(f"slurmrl: error: model.path={ckpt}: {ckpt}/config.json")
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    os.chmod(ckpt / "config.json", 0)
    res = _cli([f"model.path={ckpt}"], tmp_path)
    assert res.returncode == 2 and f"model.path={ckpt}" in res.stderr and "Traceback" not in res.stderr, res.stderr
