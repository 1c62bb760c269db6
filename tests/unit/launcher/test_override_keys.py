"""Unknown command-line keys (launcher/override_keys.py): the project's own message with the valid
keys of the section and a "did you mean" by edit distance, never Hydra's "+key" advice; several
at once in one message; free-form mappings (per-group sbatch flags) take new keys without ``+``."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launcher.config_store import register
from launcher.override_keys import checked_overrides, did_you_mean, edit_distance
from tests.conftest import REPO


@pytest.fixture(scope="module", autouse=True)
def schemas():
    register()


def test_edit_distance_and_guess():
    assert edit_distance("lrr", "lr") == 1 and edit_distance("kitten", "sitting") == 3
    assert did_you_mean("lrr", ["lr", "betas", "grad_clip"]) == "lr"
    assert did_you_mean("num_layerz", ["num_layers", "num_heads"]) == "num_layers"
    assert did_you_mean("zzzzzz", ["lr", "betas"]) is None  # nothing close: no guess


def test_unknown_keys_get_valid_keys_and_a_guess_for_the_chosen_schema():
    args, errors = checked_overrides(["trainer.lrr=1e-4", "env=dataset", "env.pathh=/x", "orchestrator.batch=3"])
    assert args[0] == "trainer.lrr=1e-4" and len(errors) == 3
    assert errors[0].startswith("trainer.lrr is not a config key. Did you mean trainer.lr? Valid keys under trainer (TrainerConfig):")
    assert "Did you mean env.path?" in errors[1] and "prompt_key" in errors[1]  # env=dataset's schema, not the default
    assert "Did you mean" not in errors[2] and "num_prompts_per_step" in errors[2]
    assert checked_overrides(["trainer.lr.x=1"])[1] == ["trainer.lr is a value, not a section: trainer.lr.x has no meaning"]
    assert checked_overrides(["trainer.lr=1e-4,3e-4", "env=dataset,reverse_digits", "env.path=/x"])[1] == []


def test_unknown_group_options_get_the_closest_one():
    errors = checked_overrides(["env=datasett", "model=tiny_dense", "experiment=tiny_locl"])[1]
    assert errors[0].startswith("env=datasett is not an option of env. Did you mean env=dataset? Options: ")
    assert "verifiers" in errors[0] and "Did you mean experiment=tiny_local?" in errors[1] and len(errors) == 2
    assert checked_overrides(["env=dataset,reverse_digits", "model=tiny_dense"])[1] == []


def test_options_in_the_users_search_path_count_and_are_listed(tmp_path):
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "first_digit.yaml").write_text("_target_: mine.FirstDigit\n")
    path = f"hydra.searchpath=[file://{tmp_path}]"
    assert checked_overrides([path, "env=first_digit"])[1] == []
    (error,) = checked_overrides([path, "env=first_digt"])[1]
    assert "Did you mean env=first_digit?" in error and "dataset" in error  # theirs and ours
    assert checked_overrides(["env=first_digit"])[1][0].startswith("env=first_digit is not an option of env.")
    assert checked_overrides(["hydra.searchpath=[pkg://mine.conf]", "env=first_digit"])[1] == []  # Hydra checks


def test_free_form_sbatch_flags_need_no_plus():
    args, errors = checked_overrides(["cluster.groups.trainer.sbatch_flags.constraint=h200",
                                      "cluster.sbatch_flags.comment=x", "+cluster.sbatch_flags.mem=1G"])
    assert errors == []
    assert args == ["++cluster.groups.trainer.sbatch_flags.constraint=h200", "++cluster.sbatch_flags.comment=x",
                    "+cluster.sbatch_flags.mem=1G"]


def cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "launcher", f"cluster.runs_root={tmp_path}", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_answers_with_its_own_message(tmp_path):
    out = cli(tmp_path, "trainer.lrr=1e-4", "model.num_layerz=2", "launcher.dry_run=true")
    assert out.returncode == 2
    assert out.stderr.startswith("slurmrl: error: 2 unknown keys:\n  - trainer.lrr is not a config key. Did you mean "
                                 "trainer.lr?"), out.stderr
    assert "Did you mean model.num_layers?" in out.stderr and "+trainer" not in out.stderr and "append" not in out.stderr
    plus = cli(tmp_path, "+trainer.lrr=1e-4", "launcher.dry_run=true")  # with Hydra's "+", the same guess
    assert plus.returncode == 2 and "did you mean trainer.lr?" in plus.stderr.lower(), plus.stderr
    ok = cli(tmp_path, "cluster=local_slurm", "cluster.groups.trainer.sbatch_flags.constraint=h200",
             "launcher.dry_run=true")
    assert ok.returncode == 0, ok.stderr[-2000:]
    trainer_part = ok.stdout.split("#SBATCH hetjob")[-1]
    assert "#SBATCH --constraint=h200" in trainer_part
