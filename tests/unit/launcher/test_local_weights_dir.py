"""launcher/weights_dir.py: a local GPU run publishes its weight steps to /dev/shm (a symlink
run_dir/weights -> <dir>/<run>/weights) and gets them back into the run directory at the end."""
from __future__ import annotations

import os

from launcher import weights_dir
from launcher.launch import prepare, write
from tests.conftest import compose
from workers.common.protocol import RunPaths, latest_stable_step


def test_auto_is_shm_only_where_the_roles_have_gpus(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = compose([])

    def where(c, **kw):
        return weights_dir.resolve(c, **kw)[0].launcher.local_weights_dir

    assert where(cfg, has_gpus=True, shm=shm, num_params=1000) == str(shm / "slurmrl")
    assert where(cfg, has_gpus=False, shm=shm) == "run_dir"
    assert where(cfg, has_gpus=True, shm=tmp_path / "none") == "run_dir"
    mine = compose([f"launcher.local_weights_dir={tmp_path / 'fast'}"])
    assert where(mine, has_gpus=False) == str(tmp_path / "fast")
    slurm = compose(["cluster=local_slurm", f"launcher.local_weights_dir={tmp_path / 'fast'}"])
    assert where(slurm, has_gpus=True) == "run_dir"
    # a /dev/shm too small for keep_last + 1 steps (a container's 64 MB): the run directory, and why
    huge, note = weights_dir.resolve(cfg, has_gpus=True, shm=shm, num_params=10**15)
    assert huge.launcher.local_weights_dir == "run_dir"
    assert "GB for weights.keep_last(3) + 1 steps: published steps stay in the run directory" in note


def test_link_publish_through_it_then_settle(tmp_path):
    fast = tmp_path / "fast"
    cfg = compose(["launcher.dry_run=false", f"launcher.local_weights_dir={fast}", f"cluster.runs_root={tmp_path / 'runs'}",
                   f"launcher.run_dir={tmp_path / 'runs' / 'r1'}"])
    prep = prepare(cfg)
    paths = write(prep)
    weights = paths.root / "weights"
    assert weights.is_symlink() and weights.resolve() == fast / "r1" / "weights"
    assert "published steps in " + str(fast / "r1" / "weights") in weights_dir.line(prep.cfg, prep.root)
    for step in (1, 2):  # what a publisher does: a temp dir renamed into place, STABLE inside
        tmp = weights / f".step_{step:06d}.tmp"
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"x" * 10)
        (tmp / "STABLE").write_text("")
        os.rename(tmp, weights / f"step_{step:06d}")
    assert latest_stable_step(weights) == 2 and (fast / "r1" / "weights" / "step_000002" / "STABLE").exists()
    assert weights_dir.settle(paths) == fast / "r1" / "weights"
    assert not weights.is_symlink() and latest_stable_step(weights) == 2
    assert (weights / "step_000001" / "model.safetensors").read_bytes() == b"x" * 10
    assert not (fast / "r1").exists()  # the memory is given back
    assert weights_dir.settle(paths) is None  # nothing linked any more


def test_dry_run_links_nothing_and_run_dir_keeps_a_plain_directory(tmp_path):
    fast = tmp_path / "fast"
    cfg = compose([f"launcher.local_weights_dir={fast}", f"cluster.runs_root={tmp_path}",
                   f"launcher.run_dir={tmp_path / 'dry'}", "launcher.dry_run=true"])
    paths = write(prepare(cfg))
    assert (paths.root / "weights").is_dir() and not (paths.root / "weights").is_symlink() and not fast.exists()
    cfg = compose(["launcher.dry_run=false", f"cluster.runs_root={tmp_path}", f"launcher.run_dir={tmp_path / 'plain'}"])
    paths = write(prepare(cfg))  # this CPU machine: auto = run_dir
    assert not (paths.root / "weights").is_symlink()


def test_a_dangling_link_gets_its_directory_back(tmp_path):
    fast = tmp_path / "fast"
    cfg = compose([f"launcher.local_weights_dir={fast}"])
    paths = RunPaths(tmp_path / "r2")
    paths.root.mkdir()
    (paths.root / "weights").symlink_to(fast / "r2" / "weights")  # /dev/shm emptied by a reboot
    weights_dir.link(cfg, paths)
    assert (fast / "r2" / "weights").is_dir()
    paths.ensure()  # what a resume's rewrite_run_dir does next
