"""A verdict as an HTML fragment for the sidecar's page (dynprof/watch/html.py): the conclusion,
culprits, ranks, unanswered nodes and evidence, every value escaped (a verdict is untrusted),
bounded, and nothing loaded or run."""

from __future__ import annotations

import re
from typing import Any

from dynprof.watch import html as vhtml
from dynprof.watch.model import Culprit, Verdict
from tests.support.verdicts import hang_verdict


def _verdict(**kw: Any) -> Verdict:
    return hang_verdict(**{"decided_at": 104.5, **kw})


def test_the_heading_names_the_kind_in_words_and_the_conclusion_follows():
    # GIVEN verdicts of each known kind
    for kind, label in [
        ("hang", "Hang"),
        ("busy", "Busy, not hung"),
        ("agent-down", "Agents down"),
        ("ok", "No finding"),
    ]:
        # WHEN rendered
        page = vhtml.verdict_html(_verdict(kind=kind))

        # THEN the heading says the kind for people, and the fragment is one section
        assert f"<h2>{label}: job job-7</h2>" in page, page
        assert page.startswith(f"<section class='verdict {kind}'>") and page.endswith("</section>")
        assert "<p class='conclusion'>rank 3 never entered the all_reduce</p>" in page


def test_hostile_values_stay_text():
    # GIVEN a verdict whose every field carries markup
    evil = "<script>alert(1)</script>"
    verdict = _verdict(
        kind="x' onmouseover='alert(1)",
        job=evil,
        conclusion=evil,
        culprits=[Culprit(rank=1, host=evil, where=evil, why=evil)],
        ranks=[{"rank": evil, "host": evil, "state": evil}],
        nodes_unanswered=[evil],
        evidence={evil: {"k": evil}},
    )

    # WHEN rendered
    page = vhtml.verdict_html(verdict)

    # THEN the only tags are the fragment's own, no attribute is broken out of, and nothing is loaded
    tags = set(re.findall(r"<\s*([a-zA-Z0-9]+)", page))
    assert tags <= {"section", "h2", "h3", "p", "table", "tr", "th", "td", "code", "details", "summary", "pre"}, tags
    assert "&lt;script&gt;" in page
    assert "onmouseover='" not in page, "a quote in the kind must not close the class attribute"


def test_culprits_and_ranks_are_tables_with_extra_columns_only_when_some_rank_has_them():
    # GIVEN one culprit, ranks of which one has a straggler score
    verdict = _verdict(
        culprits=[Culprit(rank=3, host="node-2", where="f (a.py:1)", why="late", pid=99, since_step=7)],
        ranks=[{"rank": 0, "host": "n", "step": 5, "last_step_age_s": 1.25}, {"rank": 3, "score": 0.3}],
    )

    # WHEN rendered
    page = vhtml.verdict_html(verdict)

    # THEN the culprit's row has each field, the rank table gets a SCORE column, no STEP_MS column
    assert "<td>3</td><td>node-2</td><td>99</td><td><code>f (a.py:1)</code></td><td>late</td><td>7</td>" in page
    assert "<th>SCORE</th>" in page and "<th>STEP_MS</th>" not in page
    assert "<td>1.25</td>" in page, "a float is shown with 3 significant digits"
    assert "<td>-</td>" in page, "a missing value is shown as '-'"


def test_no_culprits_no_ranks_no_nodes_means_no_tables():
    # GIVEN a verdict of no finding
    page = vhtml.verdict_html(_verdict(kind="ok", decided_at=0.0))

    # THEN there is no table, no list of nodes, no time
    assert "<table" not in page and "Nodes that did not answer" not in page and "decided" not in page


def test_the_rank_rows_are_bounded_and_the_rest_counted():
    # GIVEN more ranks than the page shows
    ranks = [{"rank": i} for i in range(vhtml.MAX_RANK_ROWS + 3)]

    # WHEN rendered
    page = vhtml.verdict_html(_verdict(ranks=ranks))

    # THEN MAX_RANK_ROWS rows (plus the header) and a count of the others
    assert page.count("<tr>") == vhtml.MAX_RANK_ROWS + 1
    assert "<p>... 3 more rank(s)</p>" in page


def test_evidence_is_folded_and_cut_at_its_limit():
    # GIVEN a small and a huge piece of evidence
    verdict = _verdict(evidence={"stacks": {"a": 1}, "samples": ["x" * (vhtml.MAX_EVIDENCE_CHARS * 2)]})

    # WHEN rendered
    page = vhtml.verdict_html(verdict)

    # THEN each is a folded block, the huge one cut
    assert page.count("<details class='evidence'>") == 2
    assert "<summary>evidence: stacks</summary>" in page
    assert "... (cut)" in page
    assert len(page) < vhtml.MAX_EVIDENCE_CHARS * 2


def test_the_time_to_decide_is_shown_only_when_both_times_are_known_and_in_order():
    # GIVEN a verdict decided 4.5 s after detection, one with no detection time and one out of order
    # THEN only the first says how long it took
    assert "<p class='times'>decided 4.5 s after detection</p>" in vhtml.verdict_html(_verdict())
    assert "decided" not in vhtml.verdict_html(_verdict(detected_at=0.0))
    assert "decided" not in vhtml.verdict_html(_verdict(detected_at=200.0))


class _Artifact:
    def __init__(self, doc: Any) -> None:
        self.doc = doc
        self.asked: list[tuple[str, int]] = []

    def read_json(self, name: str, max_bytes: int) -> Any:
        self.asked.append((name, max_bytes))
        return self.doc


def test_an_artifact_is_read_bounded_through_the_verdict_decoder():
    # GIVEN a verdict artifact with a culprit
    verdict = _verdict(culprits=[Culprit(rank=3, host="node-2", where="w", why="y")])
    artifact = _Artifact(verdict.to_json())

    # WHEN the page renders it
    page = vhtml.render_html(artifact)

    # THEN verdict.json was read with the verdict's bound, and the fragment is the verdict's
    assert artifact.asked == [(vhtml.VERDICT_FILE, vhtml.MAX_VERDICT_BYTES)]
    assert page == vhtml.verdict_html(verdict)
