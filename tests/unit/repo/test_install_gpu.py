"""``make install-gpu`` in its dry form (tools/install_gpu.py --dry-run): the exact pinned commands for a
GPU node or a shared-filesystem venv, and the pins checked against their sources (setup.cfg's sglang
extra, the Makefile's TORCH_PIN, the installed sglang's own torch requirement). What this proves:
the commands and pins are the documented ones and agree with each other; NOT that PyTorch's CUDA
index serves them (the dry form never reaches the network)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tools import install_gpu

VENV = "/shared/venvs/slurmrl"


def dry(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "tools/install_gpu.py", "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_cluster_install_with_sglang_prints_its_pinned_commands():
    lines = dry("--venv", VENV)
    py = f"{VENV}/bin/python"
    assert lines[0] == "pins: sglang==0.5.23 smg==1.13.0 (setup.cfg extra 'sglang')"
    # make test installs sglang's metadata (make install-sglang): then its own torch pin is checked
    installed = install_gpu.sglang_requires() is not None
    assert lines[1] == ("pins: torch==2.14.1 is what the installed sglang requires (torch==2.14.1)" if installed else
                        "pins: torch==2.14.1 for SGLang: not checked here (sglang's metadata is not installed; make "
                        "install-sglang installs it)")
    assert lines[2:] == [
        f"would run: {sys.executable} -m venv {VENV}",
        f"would run: {py} -m pip install --upgrade pip",
        f"would run: {py} -m pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/cu130",
        f"would write {VENV}/torch-constraint.txt: torch==2.14.1",
        f"would run: {py} -m pip install -c {VENV}/torch-constraint.txt --extra-index-url "
        f"https://download.pytorch.org/whl/cu130 -e '{REPO}[gpu,sglang]'",
        f"would run: {py} -c 'import torch, workers; print(torch.__version__, torch.version.cuda, "
        f"torch.cuda.device_count())'"]


def test_make_install_gpu_dry_without_sglang_uses_the_tested_torch():
    proc = subprocess.run(["make", "-s", "install-gpu", "DRY=1", "SGLANG=0", "CUDA=cu128", f"VENV={VENV}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "pins: torch==2.13.0 (the Makefile's TORCH_PIN, the version CI tests)" in out
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" in out
    assert f"-e '{REPO}[gpu]'" in out and "sglang]" not in out


def test_pins_that_disagree_with_their_sources_are_refused():
    setup_cfg, makefile = (REPO / "setup.cfg").read_text(), (REPO / "Makefile").read_text()
    assert install_gpu.makefile_torch(makefile) == "2.13.0"
    with pytest.raises(SystemExit, match=r"installed sglang requires \['torch==2.15.0'\]: update SGLANG_TORCH"):
        install_gpu.check_pins(setup_cfg, makefile, ["torch==2.15.0", "xgrammar"], sglang=True)
    no_pin = setup_cfg.replace("sglang==0.5.23", "sglang>=0.5")
    with pytest.raises(SystemExit, match=r"setup.cfg: the sglang extra must pin sglang== and smg=="):
        install_gpu.check_pins(no_pin, makefile, None, sglang=True)
    with pytest.raises(SystemExit, match=r"--cuda cu128: SGLang 0.5.23's kernels are CUDA 13 builds"):
        install_gpu.main(["--dry-run", "--cuda", "cu128"])
