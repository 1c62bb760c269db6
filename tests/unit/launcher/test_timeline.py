"""The loop's timeline (workers/common/timeline.py, launcher/timeline.py): marks in, phases and one line out.

A hand-built timeline of known marks: every phase is the difference it documents, the summary's
``loop_interval_over_bound`` is the per-step median, a restarted role's repeated step keeps its
last record and a torn last line (a role killed mid-write) is skipped.
"""
from __future__ import annotations

import pytest

from launcher.timeline import step_phases, summarize, summary_line
from workers.common.timeline import TimelineWriter, read_timeline, timeline_file


def write_run(root, steps: int = 6, *, busy: float = 1.0, gen: float = 0.5, gap: float = 0.25) -> None:
    """A trainer-bound run: each step waits ``gap`` for its batch, then is busy ``busy`` s (load 0.1,
    train busy-0.3, publish 0.2); the orchestrator writes batch N+1 while step N trains."""
    tr, orch = TimelineWriter(root, "trainer"), TimelineWriter(root, "orchestrator")
    t = 1000.0
    for n in range(1, steps + 1):
        written = t + gap - 0.01  # the batch lands just before the trainer sees it (its poll)
        orch.write("batch", n, first_group_done=written - 0.3, last_group_done=written - 0.05, write_start=written - 0.03,
                   batch_written=written, generation_s=gen, groups=4, reward_s=0.02)
        ready = t + gap
        tr.write("step", n, wait_start=t, batch_ready=ready, loaded=ready + 0.1, trained=ready + busy - 0.2,
                 published=ready + busy)
        orch.write("apply", n, start=ready + busy + 0.04, end=ready + busy + 0.12)
        t = ready + busy
    tr.close()
    orch.close()


def test_phases_are_the_documented_differences(tmp_path):
    write_run(tmp_path)
    ph = step_phases(tmp_path)
    assert sorted(ph) == [1, 2, 3, 4, 5, 6] and "interval" not in ph[1]
    p = ph[3]
    assert p["interval"] == pytest.approx(1.25) and p["trainer_busy"] == pytest.approx(1.0)
    assert p["handoff"] == pytest.approx(0.01) and p["batch_write"] == pytest.approx(0.03)
    assert p["assemble"] == pytest.approx(0.02) and p["load"] == pytest.approx(0.1)
    assert p["train"] == pytest.approx(0.7) and p["publish"] == pytest.approx(0.2)
    assert p["apply_wait"] == pytest.approx(0.04) and p["apply"] == pytest.approx(0.08)
    assert p["generation"] == 0.5 and p["reward"] == 0.02


def test_summary_ratio_and_biggest_other(tmp_path):
    write_run(tmp_path)
    s = summarize(tmp_path)
    assert s["steps"] == 5  # step 1 left out
    assert s["loop_interval_over_bound"] == pytest.approx(1.25)
    assert s["biggest_other"] == "publish" and s["biggest_other_s"] == pytest.approx(0.2)
    line = summary_line(tmp_path)
    assert "loop_interval_over_bound 1.25" in line and "biggest other phase: publish 0.200 s" in line


def test_ratio_is_per_step_not_median_over_median(tmp_path):
    """A run whose step time halves midway: intervals and busy times of one step go together."""
    write_run(tmp_path / "a", steps=5, busy=2.0, gap=0.0)
    tl = read_timeline(tmp_path / "a")
    tr = TimelineWriter(tmp_path / "a", "trainer")
    t = tl[("trainer", "step")][5]["published"]
    for n in range(6, 11):  # faster steps, still no wait
        tr.write("step", n, wait_start=t, batch_ready=t, loaded=t, trained=t + 0.4, published=t + 0.5)
        t += 0.5
    tr.close()
    assert summarize(tmp_path / "a")["loop_interval_over_bound"] == pytest.approx(1.0)


def test_generation_bound_run(tmp_path):
    """The trainer waits for every batch: the bound is generation and the waiting is no phase."""
    write_run(tmp_path, busy=0.4, gen=0.6, gap=0.2)
    s = summarize(tmp_path)
    assert s["bound_s"] == pytest.approx(0.6) and s["loop_interval_over_bound"] == pytest.approx(1.0)


def test_restarted_role_and_torn_line(tmp_path):
    write_run(tmp_path, steps=3)
    w = TimelineWriter(tmp_path, "trainer")
    w.write("step", 3, wait_start=0.0, batch_ready=1.0, loaded=1.0, trained=1.0, published=9.0)  # a restart redid 3
    w.close()
    with open(timeline_file(tmp_path, "trainer"), "a") as f:
        f.write('{"kind": "step", "step": 4, "wait_st')
    tl = read_timeline(tmp_path)
    assert sorted(tl[("trainer", "step")]) == [1, 2, 3] and tl[("trainer", "step")][3]["published"] == 9.0


def test_no_timeline_no_line(tmp_path):
    assert summarize(tmp_path) == {"steps": 0, "bound_s": None, "interval_over_bound_of_medians": None,
                                   "loop_interval_over_bound": None}
    assert summary_line(tmp_path) is None
    with pytest.raises(ValueError, match="timeline role"):
        timeline_file(tmp_path, "inference")


def test_the_engines_own_split_of_apply_is_reported_when_apply_is_the_biggest(tmp_path):
    """An embedded engine answers where its update went (weight_swap.py); the orchestrator keeps the
    slowest worker's parts in the apply record (``engine_*_s``), which become ``engine_*`` phases."""
    from workers.weights.coordinator import slowest_parts

    parts = slowest_parts([{"update_timing": {"read_s": 0.01, "stage_s": 0.05, "lock_wait_s": 0.002, "swap_s": 0.003,
                                              "total_s": 0.065}},
                           {"update_timing": {"read_s": 0.02, "stage_s": 0.04, "lock_wait_s": 0.3, "swap_s": 0.001,
                                              "total_s": 0.36}},
                           None, {"success": True}])  # left behind, or an engine that does not say
    assert parts == {"read_s": 0.02, "stage_s": 0.05, "lock_wait_s": 0.3, "swap_s": 0.003, "total_s": 0.36}
    tr, orch = TimelineWriter(tmp_path, "trainer"), TimelineWriter(tmp_path, "orchestrator")
    t = 0.0
    for n in range(1, 5):
        orch.write("batch", n, first_group_done=t, last_group_done=t, write_start=t, batch_written=t, generation_s=0.2)
        tr.write("step", n, wait_start=t, batch_ready=t, loaded=t, trained=t + 0.2, published=t + 0.25)
        orch.write("apply", n, start=t + 0.25, end=t + 0.65, **{f"engine_{k}": v for k, v in parts.items()})
        t += 0.7
    tr.close()
    orch.close()
    ph = step_phases(tmp_path)[3]
    assert ph["engine_lock_wait"] == pytest.approx(0.3) and ph["engine_stage"] == pytest.approx(0.05)
    assert ph["apply"] == pytest.approx(0.4)
    line = summary_line(tmp_path)
    assert "biggest other phase: apply 0.400 s (engine: read 0.020, stage 0.050, lock_wait 0.300, swap 0.003)" in line
