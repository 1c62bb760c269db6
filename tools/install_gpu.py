"""Install slurmrl for GPUs into one venv: a GPU node, or a cluster's shared filesystem.

    make install-gpu VENV=/shared/venvs/slurmrl            # CUDA torch + .[gpu,sglang], every node sees it
    make install-gpu VENV=/shared/venvs/slurmrl SGLANG=0   # trainer + embedded engine only
    make install-gpu DRY=1                                 # print the pinned commands, check the pins, install nothing
    python3 tools/install_gpu.py --venv DIR [--cuda cu130] [--no-sglang] [--dry-run]

Why a script and these pins: one venv serves every role of a run (the launcher on the login node,
trainer ranks, embedded engines, SGLang servers: ``cluster.python`` defaults to the launcher's
interpreter), so it must hold ONE torch that both SGLang and our trainer accept. SGLang pins its
torch exactly (sglang 0.5.23: ``torch==2.14.1``, CUDA 13 kernels), so with SGLang that is the torch,
installed first from PyTorch's CUDA index and held by a constraint while ``-e .[gpu,sglang]``
resolves the rest (pip would otherwise replace it with the default PyPI build). Without SGLang
the torch is the Makefile's ``TORCH_PIN`` (the version CI tests), as a CUDA build.

``--dry-run`` prints exactly the commands it would run and checks that the pins agree with their
sources: sglang/smg with setup.cfg's ``sglang`` extra, the no-SGLang torch with the Makefile's
TORCH_PIN, and the SGLang torch with the installed sglang's own requirement when its metadata is
present (``make install-sglang`` puts it there). It does not reach the network: whether the CUDA
index serves that build for this platform is only known when the real install runs.

Standard library only: it runs with the system python3 before the venv exists.
"""
from __future__ import annotations

import argparse
import configparser
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
SGLANG_TORCH = "2.14.1"
"""The torch sglang (setup.cfg's pin) requires; with SGLang, the venv's torch."""
CUDA_DEFAULT = "cu130"
"""PyTorch's CUDA index tag: CUDA 13, what SGLang 0.5.23's kernels (flashinfer cu13) are built for
(driver >= 580). Without SGLang ``--cuda cu128`` (CUDA 12.8) works on older drivers."""
INDEX = "https://download.pytorch.org/whl/{cuda}"


def makefile_torch(makefile: str) -> str:
    """The version of the Makefile's ``TORCH_PIN := torch==X`` (what CI tests on the CPU)."""
    m = re.search(r"^TORCH_PIN\s*:=\s*torch==(\S+)", makefile, re.M)
    if m is None:
        raise SystemExit("Makefile: no TORCH_PIN := torch==X line")
    return m.group(1)


def extra_pins(setup_cfg: str, extra: str) -> list[str]:
    """The requirement lines of one extra of setup.cfg (comments dropped)."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(setup_cfg)
    text = parser.get("options.extras_require", extra, fallback="")
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def sglang_requires() -> Optional[list[str]]:
    """Requirements of the installed sglang (its metadata), None when sglang is not installed here."""
    try:
        import importlib.metadata as metadata

        return list(metadata.requires("sglang") or [])
    except Exception:  # PackageNotFoundError, or no metadata
        return None


def check_pins(setup_cfg: str, makefile: str, requires: Optional[list[str]], *, sglang: bool) -> list[str]:
    """Lines saying what was checked; SystemExit naming the file when a pin disagrees with its source."""
    out = []
    if sglang:
        pins = extra_pins(setup_cfg, "sglang")
        if not any(p.startswith("sglang==") for p in pins) or not any(p.startswith("smg==") for p in pins):
            raise SystemExit(f"setup.cfg: the sglang extra must pin sglang== and smg== (has {pins})")
        out.append(f"pins: {' '.join(pins)} (setup.cfg extra 'sglang')")
        if requires is None:
            out.append(f"pins: torch=={SGLANG_TORCH} for SGLang: not checked here (sglang's metadata is not installed; "
                       f"make install-sglang installs it)")
        else:
            wanted = [r for r in requires if re.match(r"torch\s*[=<>~!]", r)]
            if wanted != [f"torch=={SGLANG_TORCH}"]:
                raise SystemExit(f"tools/install_gpu.py: SGLANG_TORCH={SGLANG_TORCH} but the installed sglang requires "
                                 f"{wanted or 'no torch pin'}: update SGLANG_TORCH with setup.cfg's sglang pin")
            out.append(f"pins: torch=={SGLANG_TORCH} is what the installed sglang requires ({wanted[0]})")
    else:
        out.append(f"pins: torch=={makefile_torch(makefile)} (the Makefile's TORCH_PIN, the version CI tests)")
    return out


def commands(venv: Path, *, cuda: str, sglang: bool, torch: str) -> list[list[str]]:
    """The install, in order (each a command line run as is)."""
    py = str(venv / "bin" / "python")
    constraint = str(venv / "torch-constraint.txt")
    extras = "gpu,sglang" if sglang else "gpu"
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [py, "-m", "pip", "install", "--upgrade", "pip"],
        [py, "-m", "pip", "install", f"torch=={torch}", "--index-url", INDEX.format(cuda=cuda)],
        ["write", constraint, f"torch=={torch}"],  # holds the CUDA build while the extras resolve
        [py, "-m", "pip", "install", "-c", constraint, "--extra-index-url", INDEX.format(cuda=cuda),
         "-e", f"{REPO}[{extras}]"],
        [py, "-c", "import torch, workers; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"],
    ]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/install_gpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--venv", default=".venv", help="venv directory (on a cluster: a shared filesystem path)")
    p.add_argument("--cuda", default=CUDA_DEFAULT, help=f"PyTorch CUDA index tag (default {CUDA_DEFAULT})")
    p.add_argument("--no-sglang", action="store_true", help="trainer + embedded engine only (no SGLang servers)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and check the pins; install nothing")
    args = p.parse_args(argv)
    sglang = not args.no_sglang
    if sglang and not args.cuda.startswith("cu13"):
        raise SystemExit(f"--cuda {args.cuda}: SGLang 0.5.23's kernels are CUDA 13 builds; use --cuda cu130, or "
                         f"--no-sglang for a CUDA 12 torch")
    makefile = (REPO / "Makefile").read_text()
    for line in check_pins((REPO / "setup.cfg").read_text(), makefile, sglang_requires() if sglang else None,
                           sglang=sglang):
        print(line, flush=True)
    venv = Path(args.venv).expanduser().absolute()
    torch = SGLANG_TORCH if sglang else makefile_torch(makefile)
    cmds = commands(venv, cuda=args.cuda, sglang=sglang, torch=torch)
    if venv.exists() and (venv / "bin" / "python").exists():
        cmds = cmds[1:]  # an existing venv is reused
    for cmd in cmds:
        if cmd[0] == "write":
            print(f"{'would write' if args.dry_run else 'write'} {cmd[1]}: {cmd[2]}", flush=True)
            if not args.dry_run:
                Path(cmd[1]).write_text(cmd[2] + "\n")
            continue
        print(("would run: " if args.dry_run else "+ ") + shlex.join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True)
    if not args.dry_run:
        print(f"installed into {venv}; on a cluster point every node at it (cluster.python={venv}/bin/python, or "
              f"run slurmrl from it: its interpreter is the default)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
