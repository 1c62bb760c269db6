"""experiment=tiny_swe end to end: the real CLI, engine, multi-turn tool episodes, sandbox and hidden-test
reward on CPU, with per-env metrics in metrics.jsonl."""
from __future__ import annotations

from tests.integration.conftest import assert_no_children_left, metrics, slurmrl


def test_tiny_swe_run_reports_per_env_metrics(tmp_path):
    run_dir = tmp_path / "swe"
    out = slurmrl(["experiment=tiny_swe", "trainer.num_steps=2", f"launcher.run_dir={run_dir}"], tmp_path, timeout=400)
    assert "finished: 2 steps" in out.stdout, out.stdout[-2000:]
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 1 <= r["env/swe/episode_turns_mean"] <= 4 and r["env/swe/episode_tokens_max"] <= 576
        assert r["env/swe/sandbox_runs"] >= 1  # at least the hidden tests of every episode ran
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["num_loss_tokens"] > 0
    assert_no_children_left(run_dir)
