"""The recipes through the real CLI (trainer, two embedded workers, orchestrator as processes):
DAPO's dynamic sampling and overlong shaping with the KL penalty to the step-0 reference, and
on-policy distillation from a published step of that run as the teacher."""
from __future__ import annotations

import pytest

from tests.integration.conftest import SMALL, metrics, slurmrl

pytestmark = pytest.mark.slow


def test_dapo_with_reference_kl_then_distillation_from_its_weights(tmp_path):
    run_dir = tmp_path / "dapo"
    out = slurmrl([*SMALL, "model=tiny_dense", "algorithm=dapo", "trainer.kl_coef=0.01", "trainer.kl_estimator=k3",
                   "trainer.num_steps=4", "launcher.run_dir=" + str(run_dir)], tmp_path)
    assert "algorithm dapo: advantage=token_rtg/group_std, loss_agg=token_mean" in out.stdout
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[0]["ref_kl"] < 1e-6  # step 1 trains the step-0 weights: the reference itself
    assert all(r["ref_kl"] > 0 for r in recs[1:]), [r["ref_kl"] for r in recs]  # k3 >= 0, > 0 once it moved
    for r in recs:
        assert "groups_dropped_zero_var_total" in r and -1.0 <= r["overlong_penalty_mean"] <= 0.0
        assert 0.0 <= r["clip_frac"] <= 1.0
    teacher = sorted((run_dir / "weights").glob("step_*"))[-1]
    assert (teacher / "config.json").is_file()  # a Hugging Face directory (tiny_dense is Llama-shaped)
    student = tmp_path / "student"
    out = slurmrl([*SMALL, "model=tiny_dense", "algorithm=on_policy_distill", f"algorithm.teacher.path={teacher}",
                   "trainer.num_steps=3", "launcher.run_dir=" + str(student)], tmp_path)
    recs = metrics(student)
    assert len(recs) == 3
    assert "| teacher kl " in out.stdout, out.stdout[-2000:]  # on the progress line (issue 47 item 16)
    assert all("teacher_reverse_kl" in r for r in recs)
    assert recs[0]["teacher_reverse_kl"] > 0.0  # the student (step 0) differs from its trained teacher


def test_a_teacher_with_another_vocabulary_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "r"
    slurmrl([*SMALL, "model=tiny_dense", "trainer.num_steps=1", "launcher.run_dir=" + str(run_dir)], tmp_path)
    teacher = sorted((run_dir / "weights").glob("step_*"))[-1]
    out = slurmrl([*SMALL, "algorithm=on_policy_distill", f"algorithm.teacher.path={teacher}",
                   "model=tiny_dense", "model.vocab_size=32", f"launcher.run_dir={tmp_path / 'no'}"], tmp_path,
                  check=False)
    assert out.returncode != 0 and "the teacher's vocab_size is 16" in out.stdout + out.stderr
    assert not (tmp_path / "no").exists()
