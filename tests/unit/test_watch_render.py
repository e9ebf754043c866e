"""A verdict as text for people (dynprof/watch/render.py): the conclusion first, the timing, the
culprits, the flight recorder's and the health check's findings, the nodes that did not answer
and the table of ranks, each bounded, and every line one printable line whatever the nodes said."""

from __future__ import annotations

from typing import Any

from dynprof.watch import render
from dynprof.watch.model import Culprit, Verdict
from dynprof.watch.render import MAX_RANK_LINES, render_artifact, render_verdict_text
from tests.support.verdicts import hang_verdict


def test_the_first_line_names_the_kind_the_job_and_the_conclusion():
    # GIVEN a hang verdict with nothing else
    verdict = hang_verdict()

    # WHEN rendered
    text = render_verdict_text(verdict)

    # THEN it is one line: the kind in capitals, the job and the conclusion
    assert text == "HANG job job-7: rank 3 never entered the all_reduce"


def test_timing_and_culprits_are_shown_with_a_rank_or_else_a_pid():
    # GIVEN timings and two culprits, one known only by its pid
    verdict = hang_verdict(
        evidence={"timing": {"detection_s": 12.34, "verdict_s": 2, "look_s": True}},
        culprits=[
            Culprit(rank=3, host="node-2", where="load_batch (data.py:88)", why="not in the collective"),
            Culprit(rank=None, host="node-5", where="?", why="stopped (SIGSTOP)", pid=4242),
        ],
    )

    # WHEN rendered
    lines = render_verdict_text(verdict).split("\n")

    # THEN the ages are in seconds with one decimal, a boolean is no age, and each culprit is named
    assert lines[1] == "  detected 12.3 s after the last step; verdict 2.0 s after detection (look -)"
    assert lines[2] == "  culprit rank 3 on node-2: load_batch (data.py:88): not in the collective"
    assert lines[3] == "  culprit pid 4242 on node-5: ?: stopped (SIGSTOP)"


def test_more_than_sixteen_culprits_are_counted_not_listed():
    # GIVEN 20 culprits
    culprits = [Culprit(rank=i, host="n", where="w", why="y") for i in range(20)]

    # WHEN rendered
    lines = render_verdict_text(hang_verdict(culprits=culprits)).split("\n")

    # THEN 16 are listed and the 4 others counted
    assert sum(1 for line in lines if line.startswith("  culprit rank")) == 16
    assert "  ... 4 more culprit(s)" in lines


def test_the_flight_recorder_and_health_check_findings_are_listed_per_group_and_per_node():
    # GIVEN a flight recorder analysis (one group with a verdict, one without) and two nodes' checks
    problems = [{"name": f"check{i}", "status": "fail", "reason": f"r{i}"} for i in range(6)]
    verdict = hang_verdict(
        evidence={
            "flight_recorder": {
                "analysis": [{"process_group": "0", "verdict": "rank 3 missing"}, {"process_group": "1"}, "junk"],
                "note": "2 ranks had no dump",
            },
            "healthcheck": {"node-b": {"verdict": "ok"}, "node-a": {"verdict": "fail", "problems": problems}},
        }
    )

    # WHEN rendered
    lines = render_verdict_text(verdict).split("\n")

    # THEN the group with a verdict, the note, and the nodes in name order with at most 4 problems each
    assert "  flight recorder, group 0: rank 3 missing" in lines
    assert not any("group 1" in line for line in lines), "a group without a verdict says nothing"
    assert "  flight recorder: 2 ranks had no dump" in lines
    node_lines = [line for line in lines if line.startswith("  healthcheck")]
    assert node_lines[0].startswith("  healthcheck node-a: fail (check0 fail: r0; ")
    assert "check3" in node_lines[0] and "check4" not in node_lines[0]
    assert node_lines[1] == "  healthcheck node-b: ok"


def test_nodes_without_an_answer_are_named_up_to_twenty():
    # GIVEN 25 nodes that did not answer
    verdict = hang_verdict(nodes_unanswered=[f"n{i}" for i in range(25)])

    # WHEN rendered
    line = render_verdict_text(verdict).split("\n")[-1]

    # THEN the first 20 are named
    assert line.startswith("  no answer from: n0, n1,")
    assert "n19" in line and "n20" not in line


def test_the_rank_table_shows_where_a_rank_is_and_is_cut_at_its_limit():
    # GIVEN more ranks than the table shows, the first waiting at a known place, the second at "?"
    ranks: list[dict[str, Any]] = [
        {"rank": 0, "host": "node-1", "step": 41, "last_step_age_s": 30.0, "state": "waiting", "where": "all_reduce"},
        {"rank": 1, "host": "node-1", "step": None, "last_step_age_s": None, "state": "stopped", "where": "?"},
    ]
    ranks += [{"rank": i, "host": "h", "step": 1, "state": "moving"} for i in range(2, MAX_RANK_LINES + 5)]

    # WHEN rendered
    lines = render_verdict_text(hang_verdict(ranks=ranks)).split("\n")

    # THEN a header, MAX_RANK_LINES rows, and the count of the others
    head = lines.index("  rank  host                  step      age  state")
    rows = lines[head + 1 : head + 1 + MAX_RANK_LINES]
    assert rows[0].endswith("waiting at all_reduce") and " 41 " in rows[0] and "30.0 s" in rows[0]
    assert rows[1].endswith("stopped"), "an unknown place ('?') is not shown"
    assert rows[1].split()[2] == "?", "a rank without a step shows '?'"
    assert lines[head + 1 + MAX_RANK_LINES] == f"  ... {len(ranks) - MAX_RANK_LINES} more rank(s)"


def test_what_a_node_said_never_makes_a_line_of_its_own():
    # GIVEN a conclusion, a host and a frame with newlines and a terminal escape
    verdict = hang_verdict(
        conclusion="line one\nHANG job fake: forged",
        culprits=[Culprit(rank=1, host="evil\nhost", where="f\x1b[2J", why="w")],
        ranks=[{"rank": 1, "host": "x\ny", "state": "s\rt"}],
    )

    # WHEN rendered
    text = render_verdict_text(verdict)

    # THEN the number of lines is what the verdict has (title, culprit, header, row), none forged
    lines = text.split("\n")
    assert len(lines) == 4, lines
    assert not any(line.startswith("HANG job fake") for line in lines)
    assert "\x1b" not in text and "\r" not in text


class _Artifact:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.read: list[str] = []

    def read_json(self, name: str, *args: Any) -> Any:
        self.read.append(name)
        return self.doc


def test_the_show_renderer_reads_verdict_json_and_summarises_it():
    # GIVEN a verdict artifact
    verdict = hang_verdict(
        culprits=[Culprit(rank=3, host="node-2", where="w", why="y")],
        evidence={"timing": {"detection_s": 1.0}},
        nodes_unanswered=["node-9"],
    )
    artifact = _Artifact(verdict.to_json())

    # WHEN `dynprof show` renders it
    summary, text = render_artifact(artifact)

    # THEN it read verdict.json, and the summary and text both come from the verdict
    assert artifact.read == ["verdict.json"]
    assert summary["kind"] == "hang" and summary["job"] == "job-7"
    assert summary["culprits"] == [verdict.culprits[0].to_json()]
    assert summary["timing"] == {"detection_s": 1.0}
    assert summary["nodes_unanswered"] == ["node-9"]
    assert text == render.render_verdict_text(Verdict.from_json(verdict.to_json()))
