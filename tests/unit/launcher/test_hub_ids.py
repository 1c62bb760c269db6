"""Hub ids in model.path (launcher/hub.py): resolved offline through huggingface_hub's real cache
layout (``models--org--name/{blobs,snapshots/<commit>,refs/main}``, built here in tmp with a tiny
checkpoint transformers saved), into the run's config as the snapshot directory, with every role
told HF_HUB_OFFLINE=1 and where the cache is; a missing id offline names the cache it looked in.
(Downloading needs the Hub: not exercised here.)"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.hub import hf_home, parse_repo_id
from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError
from tests.conftest import REPO, compose
from tests.models.hf_dirs import llama_dir
from workers.common.config.run import load_run_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(home: Path, repo_id: str, source: Path) -> Path:
    """``source``'s files as huggingface_hub stores a download under ``home/hub``: content-addressed
    blobs, a snapshot of symlinks to them, ``refs/main`` naming the commit. Returns the snapshot."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    fake_hub_cache(root, "tiny-org/tiny-llama", llama_dir(root / "src", tokenizer_vocab=100))
    return root


def resolved(*overrides):
    return resolve_model_path(compose(list(overrides)), explicit_model_keys(list(overrides)))


def test_repo_ids_are_told_from_local_paths(tmp_path):
    assert parse_repo_id("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert parse_repo_id("Qwen/Qwen3-8B@a1b2c3") == ("Qwen/Qwen3-8B", "a1b2c3")
    (tmp_path / "org" / "name").mkdir(parents=True)
    os.chdir(tmp_path)
    try:
        assert parse_repo_id("org/name") is None  # an existing path is a path
    finally:
        os.chdir(REPO)
    for path in ("/models/Qwen3-8B", "./org/name", "~/org/name", "Qwen3-8B", "a/b/c", ""):
        assert parse_repo_id(path) is None, path


def test_which_cache_a_cluster_profile_uses():
    c = compose([]).cluster
    assert hf_home(compose(["cluster.hf_home=/shared/hf"]).cluster) == ("/shared/hf", "cluster.hf_home")
    assert hf_home(compose(["+cluster.env.HF_HOME=/e/hf"]).cluster) == ("/e/hf", "cluster.env.HF_HOME")
    assert hf_home(compose(["cluster.shared_root=/lustre/x"]).cluster) == ("/lustre/x/hf", "cluster.shared_root/hf")
    assert hf_home(c)[1] == "the launcher's HF_HOME"
    assert hf_home(compose(["cluster=h200_ib"]).cluster) == ("/lustre/slurmrl/hf", "cluster.env.HF_HOME")


def test_a_cached_id_resolves_offline_into_the_snapshot(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    for path in ("tiny-org/tiny-llama", "tiny-org/tiny-llama@main", f"tiny-org/tiny-llama@{COMMIT}"):
        cfg = resolved(f"model.path={path}", f"cluster.hf_home={home}")
        assert Path(cfg.model.path) == snapshot, path
        assert (cfg.model.family, cfg.model.name, cfg.model.num_layers) == ("llama", "tiny-llama", 2)
        assert cfg.cluster.env["HF_HUB_OFFLINE"] == "1" and cfg.cluster.env["HF_HOME"] == str(home)


def test_a_missing_id_offline_names_the_cache(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PlanError, match=rf"model.path=tiny-org/missing: no such directory, and as a Hugging Face hub "
                                        rf"id it is not in the cache {home}/hub \(cluster.hf_home\), and "
                                        rf"HF_HUB_OFFLINE=1 forbids a download; fetch it once"):
        resolved("model.path=tiny-org/missing", f"cluster.hf_home={home}")
    with pytest.raises(PlanError, match=r"model.path=tiny-org/tiny-llama@v9: .*not in the cache"):
        resolved("model.path=tiny-org/tiny-llama@v9", f"cluster.hf_home={home}")


def test_the_cli_writes_the_snapshot_into_the_run_config(home, tmp_path):
    """``slurmrl model.path=org/name`` as a user types it; what every role reads is the local snapshot."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launcher", "model.path=tiny-org/tiny-llama", f"cluster.hf_home={home}",
                           "launcher.dry_run=true", f"launcher.run_dir={run_dir}", f"cluster.runs_root={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = load_run_config(str(run_dir / "config" / "run.yaml"))
    assert cfg.model.path.endswith(f"models--tiny-org--tiny-llama/snapshots/{COMMIT}") and cfg.model.name == "tiny-llama"
    assert cfg.cluster.env["HF_HUB_OFFLINE"] == "1"
