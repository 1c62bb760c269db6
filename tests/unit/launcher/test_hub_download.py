"""Hub ids downloaded for real (launcher/hub.py) from a Hub on this machine: tests/fakes/fake_hub.py, a real
HTTP server speaking the Hub's file-resolution protocol, with huggingface_hub pointed at it by HF_ENDPOINT.

``slurmrl model.path=org/name`` as a user types it, with the network: the launcher downloads the files a
run reads ONCE into ``cluster.hf_home`` (huggingface_hub's own cache layout) and writes the snapshot
directory into the run's config; a second launch makes no request at all; offline (HF_HUB_OFFLINE=1) the
plan is built from the cache alone; a missing id offline is a plan-time error naming the cache. (The offline cache layout on its own, and the
CLI writing the snapshot into run.yaml: tests/unit/launcher/test_hub_ids.py.) A real download found that
huggingface_hub 2.x calls a cached partial snapshot (no ``*.bin``) incomplete unless asked with the same
patterns: launcher/hub.py passes them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.hub import DOWNLOAD
from launcher.model_path import explicit_model_keys, resolve_model_path
from launcher.plan import PlanError, build_plan
from tests.conftest import REPO, compose
from tests.fakes.fake_hub import COMMIT, FakeHub
from tests.models.hf_dirs import llama_dir
from workers.common.config.run import load_run_config

REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny checkpoint transformers saved, plus a pickled file a run must not download."""
    d = llama_dir(tmp_path_factory.mktemp("src") / "tiny-llama", tokenizer_vocab=100)
    (d / "pytorch_model.bin").write_bytes(b"pickled weights a run never reads")
    return d


@pytest.fixture(scope="module")
def hub(source):
    with FakeHub({REPO_ID: source}) as h:
        yield h


def _launch(home: Path, run_dir: Path, endpoint: str) -> subprocess.CompletedProcess:
    """``slurmrl model.path=org/name`` as a user runs it, online, with ``HF_ENDPOINT`` at the fake Hub (in a
    process of its own: huggingface_hub reads HF_ENDPOINT once, when imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, PYTHONPATH=str(REPO), HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "launcher", f"model.path={REPO_ID}", f"cluster.hf_home={home}",
                           "launcher.dry_run=true", f"launcher.run_dir={run_dir}", f"cluster.runs_root={run_dir.parent}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _resolved(*overrides):
    return resolve_model_path(compose(list(overrides)), explicit_model_keys(list(overrides)))


def test_a_hub_id_downloads_once_into_hf_home_then_plans_offline(hub, source, tmp_path, monkeypatch, capfd):
    home = tmp_path / "shared-hf"
    first = _launch(home, tmp_path / "run", hub.endpoint)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"model.path={REPO_ID}: downloading into {home / 'hub'} (cluster.hf_home), once" in first.stderr
    snapshot = home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    cfg = load_run_config(str(tmp_path / "run" / "config" / "run.yaml"))
    assert Path(cfg.model.path) == snapshot and cfg.model.name == "tiny-llama" and cfg.model.family == "llama"
    assert cfg.cluster.env["HF_HUB_OFFLINE"] == "1" and cfg.cluster.env["HF_HOME"] == str(home)
    wanted = sorted(f.name for f in source.iterdir() if f.suffix != ".bin")
    assert "model.safetensors" in wanted and "tokenizer.json" in wanted and "config.json" in wanted
    fetched = sorted(p.rsplit("/", 1)[1] for p in hub.downloads())
    assert fetched == wanted, "each file a run reads fetched exactly once; pickled weights never"
    assert all(any(Path(f).match(p) for p in DOWNLOAD) for f in fetched)
    for name in wanted:  # huggingface_hub's layout: snapshot entries are links to content-addressed blobs
        assert (snapshot / name).is_symlink() and (snapshot / name).read_bytes() == (source / name).read_bytes()
    assert (home / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == COMMIT

    before = len(hub.requests)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the next launch, online (this process's HF_ENDPOINT is
    again = _resolved(f"model.path={REPO_ID}", f"cluster.hf_home={home}")  # the real Hub: unreachable here)
    assert again.model.path == cfg.model.path and "downloading" not in capfd.readouterr().err
    assert len(hub.requests) == before, "a cached id makes no request (its partial snapshot counts as complete)"

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the plan from the cache alone
    plan = build_plan(_resolved(f"model.path={REPO_ID}", f"cluster.hf_home={home}"))
    assert any(line.startswith("model path: native family llama") for line in plan.summary())
    assert len(hub.requests) == before
    with pytest.raises(PlanError, match=rf"model.path=tiny-org/other: no such directory, and as a Hugging Face hub id "
                                        rf"it is not in the cache {home / 'hub'} \(cluster.hf_home\), and "
                                        rf"HF_HUB_OFFLINE=1 forbids a download"):
        _resolved("model.path=tiny-org/other", f"cluster.hf_home={home}")
    assert len(hub.requests) == before

