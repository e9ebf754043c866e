"""The straggler rule (dynprof.watch.straggler.rule), pure: the cause class from the analysis's
work categories, and the score and verdict from an analysis document."""

from __future__ import annotations

from dynprof.watch.straggler.rule import (
    StragglerReport,
    category_excess,
    sample_line,
    straggler_verdict,
    what_holds,
)


def _row(rank, host, ops, outside, coll, step=100.0):
    return {
        "rank": rank,
        "host": host,
        "step_ms": step,
        "step_ms_median": step,
        "cpu": {"ops": ops, "outside_ops": outside, "collective": coll, "collective_wait": 0.0},
        "gpu": None,
        "work_ms": ops + outside,
        "collective_ms": coll,
    }


def test_category_excess_is_over_the_others_mean():
    # GIVEN a rank with 30 ms more outside operators than the two others
    me = _row(2, "n2", 5.0, 40.0, 5.0)
    others = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n1", 5.0, 10.0, 35.0)]

    # WHEN its excess is measured
    excess = category_excess(me, others)

    # THEN it is in outside_ops
    assert excess == {"cpu.ops": 0.0, "cpu.outside_ops": 30.0}


def test_verdict_scores_the_straggler_and_zero_for_the_others():
    # GIVEN an analysis whose rule named rank 2 on n2, 30 ms/step over a 100 ms step
    rows = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n1", 5.0, 10.0, 35.0), _row(2, "n2<b>", 5.0, 40.0, 5.0)]
    analysis = {
        "ranks": rows,
        "common_steps": [7, 8],
        "straggler": {
            "rank": 2,
            "host": "n2<b>",
            "reason": "rank 2: ...",
            "excess_ms": 30.0,
            "work_ms": 45.0,
            "cause": "input pipeline",
        },
        "straggler_check": "straggler: rank 2 (30.0 ms/step over the others); noise threshold 10.0 ms",
    }

    # WHEN the verdict is drawn
    scores, verdict, check = straggler_verdict("j", analysis, [], 1000.0)

    # THEN rank 2 scores 0.3 (excess / median step), the others 0, and the verdict names it
    assert scores == {("n1", 0): 0.0, ("n1", 1): 0.0, ("n2<b>", 2): 0.3}
    assert verdict is not None and verdict.kind == "straggler"
    assert (verdict.culprits[0].rank, verdict.culprits[0].host) == (2, "n2<b>")
    assert verdict.evidence["straggler"]["cause"] == "input pipeline"
    assert verdict.culprits[0].since_step == 7
    assert "noise threshold" in check


def test_no_straggler_no_verdict():
    # GIVEN an analysis whose rule named none
    rows = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n2", 5.0, 11.0, 34.0)]
    analysis = {"ranks": rows, "common_steps": [1, 2], "straggler": None, "straggler_check": "no straggler: ..."}

    # WHEN the verdict is drawn / THEN there is none, every score 0
    scores, verdict, _ = straggler_verdict("j", analysis, [], 1000.0)
    assert verdict is None and scores == {("n1", 0): 0.0, ("n2", 1): 0.0}


def test_the_evidence_names_what_holds_the_extra_time_not_the_collective():
    # GIVEN a straggler whose extra time is in CPU operators; the analysis's top names lead
    # with the collective the others wait in
    rows = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n1", 5.0, 10.0, 35.0), _row(2, "n2", 35.0, 10.0, 5.0)]
    straggler = {
        "rank": 2,
        "host": "n2",
        "reason": "rank 2: 45.0 ms/step outside collectives vs 15.0 ms; the others wait in c10d::allreduce_",
        "excess_ms": 30.0,
        "cause": "CPU operators",
        "top": [{"name": "c10d::allreduce_", "ms": 30.0}, {"name": "aten::addmm", "ms": 28.0}],
    }
    analysis = {"ranks": rows, "common_steps": [3, 4], "straggler": straggler, "straggler_check": "straggler: ..."}

    # WHEN the verdict is drawn
    _, verdict, _ = straggler_verdict("j", analysis, [], 1000.0)

    # THEN its culprit and evidence quote the operator, the analysis's own cause is kept
    assert verdict is not None
    (culprit,) = verdict.culprits
    assert culprit.where == "aten::addmm"
    assert verdict.evidence["straggler"]["holds"] == "aten::addmm"
    assert verdict.evidence["straggler"]["cause"] == "CPU operators"
    assert "its extra time is in aten::addmm" in verdict.conclusion

    # and with only collectives named, the category says where, never the collective
    only = {**straggler, "top": ["c10d::allreduce_"]}
    _, verdict, _ = straggler_verdict("j", {**analysis, "straggler": only}, [], 1000.0)
    assert verdict is not None and verdict.culprits[0].where == "CPU operators"
    assert what_holds(only, "all_reduce (distributed_c10d.py:2501)") is None


def test_the_sample_line_says_what_was_found():
    # GIVEN reports: none found (the rule's line), a straggler, nothing decided
    none = StragglerReport(
        sampled_at=1.0,
        steps=2,
        at_step=1168,
        check="no straggler: work outside collectives is within 0.1 ms across ranks "
        "(max rank 1 55.1 ms/step vs 55.0 ms median); noise threshold 5.5 ms",
    )
    rows = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n2", 5.0, 40.0, 5.0)]
    analysis = {
        "ranks": rows,
        "common_steps": [9, 10],
        "straggler": {"rank": 1, "host": "n2", "reason": "rank 1: ...", "excess_ms": 30.0, "cause": "input pipeline"},
        "straggler_check": "straggler: rank 1",
    }
    _, verdict, _ = straggler_verdict("j", analysis, [], 1.0)
    found = StragglerReport(sampled_at=1.0, steps=2, at_step=9, verdict=verdict)
    failed = StragglerReport(sampled_at=1.0, steps=0, note="no rank of the job has stepped")

    # WHEN each is said / THEN the line names the step and what the sample found
    assert sample_line(none) == (
        "straggler sample at step 1168: none (work outside collectives is within 0.1 ms across ranks "
        "(max rank 1 55.1 ms/step vs 55.0 ms median); noise threshold 5.5 ms)"
    )
    line = sample_line(found)
    assert line.startswith("straggler sample at step 9: rank 1 on n2 (input pipeline, score 0.30)"), line
    assert sample_line(failed) == "straggler sample: nothing decided (no rank of the job has stepped)"


def test_the_headline_cause_is_the_one_the_analysis_measured_in_every_case():
    # GIVEN the synthetic jobs of the analysis's cause cases (each rank's trace summary)
    import pytest

    from tests.unit.test_collectors_trace_analysis_job import STRAGGLER_CASES, _job

    for case, (figures, cause) in sorted(STRAGGLER_CASES.items()):
        analysis = _job(figures, has_gpu=case != "cpu-operators")
        # WHEN the watch draws its verdict from the analysis
        _, verdict, _ = straggler_verdict("j", analysis, [], 1000.0)
        # THEN its headline, its culprit and its detail say the same cause
        assert verdict is not None, case
        assert f"is a straggler ({cause})" in verdict.conclusion, (case, verdict.conclusion)
        assert verdict.culprits[0].why.startswith(f"{cause}: "), case
        assert f"({cause}" in verdict.evidence["straggler"]["reason"], case
        assert verdict.evidence["straggler"]["cause_ms"] == pytest.approx(analysis["straggler"]["cause_ms"])
