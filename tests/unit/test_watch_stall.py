"""The watch's stall rule (dynprof.watch.stall): the stall time, the job's age, and one rule for the
watch and the sidecar."""

from __future__ import annotations

from dynprof.watch import stall as stall_rule
from tests.unit.test_watch_detect import NOW, row


def test_stall_default_is_the_larger_of_60_s_and_20_median_step_times():
    # GIVEN ranks stepping every 0.5 s, and a job of 10 s steps
    fast = [row(r) for r in range(4)]
    slow = [row(r, step_time_s=10.0) for r in range(4)]
    # WHEN / THEN
    assert stall_rule.default_stall_after(fast) == 60.0
    assert stall_rule.default_stall_after(slow) == 200.0
    assert stall_rule.check_stall(fast).stalled  # 80 s without a step
    assert not stall_rule.check_stall(slow).stalled


def test_one_rank_that_stepped_recently_means_no_stall():
    # GIVEN three ranks idle for 80 s, one that stepped 2 s ago
    rows = [row(0), row(1), row(2), row(3, age=2.0)]
    # WHEN
    stall = stall_rule.check_stall(rows, 30.0)
    # THEN the job's age is the youngest rank's
    assert not stall.stalled and stall.age_s == 2.0


def test_before_the_first_step_the_age_counts_from_the_processes_start():
    # GIVEN ranks with no step yet, started 20 s ago
    rows = [row(r, step=0, age=None, started_at=NOW - 20.0) for r in range(2)]
    # WHEN
    early = stall_rule.check_stall(rows, 30.0)
    late = stall_rule.check_stall(rows, 10.0)
    # THEN no stall is called from step ages alone: the start time counts
    assert not early.stalled and early.first_step and early.age_s == 20.0
    assert late.stalled


def test_the_stall_rule_is_one_for_the_watch_and_the_sidecar():
    # GIVEN step times of a few jobs
    from dynprof.sidecar import progress

    for times in ([], [0.0], [0.5, 0.5], [10.0, 12.0, 0.0], [4.0]):
        # WHEN / THEN the sidecar's stall time is the watch's
        assert progress.stall_after_s(list(times), None) == stall_rule.stall_after_for(times)
        rows = [row(r, step_time_s=t) for r, t in enumerate(times)]
        assert stall_rule.default_stall_after(rows) == stall_rule.stall_after_for(times)
    assert stall_rule.stall_after_for([10.0, 12.0, 0.0]) == 220.0
    assert stall_rule.stall_after_for([0.5], 7.5) == 7.5
