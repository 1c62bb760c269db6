"""env=mix end to end: two entries (short and long digit reversals) in one local run, every batch
reporting each entry's reward and episode metrics under env/<label>/."""
from __future__ import annotations

from tests.integration.conftest import SMALL, assert_no_children_left, metrics, slurmrl


def test_mixed_envs_report_per_env_metrics(tmp_path):
    run_dir = tmp_path / "mix"
    slurmrl([*SMALL, "env=mix", "env.weights.long=2.0", "trainer.num_steps=3", f"launcher.run_dir={run_dir}"],
            tmp_path, timeout=300)
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    drawn = recs[-1]["env/short/tasks_drawn_total"] + recs[-1]["env/long/tasks_drawn_total"]
    assert drawn >= 3 * 4
    for r in recs:
        labels = {k.split("/")[1] for k in r if k.startswith("env/") and k.endswith("/reward_mean")}
        assert labels and labels <= {"short", "long"}, sorted(r)
        assert all(0.0 <= r[f"env/{lb}/reward_mean"] <= 1.0 for lb in labels)
    assert {k.split("/")[1] for r in recs for k in r if k.endswith("/reward_mean") and k.startswith("env/")} == \
        {"short", "long"}
    assert_no_children_left(run_dir)
