"""The page's parts of the watch: a verdict artifact rendered as HTML (escaped: a verdict is
untrusted input), the live state of a node's ranks, and the list of verdicts."""

from __future__ import annotations

import re

from dynprof import renderers
from dynprof.sidecar.page import live_html, live_state, stall_after_s, verdict_item, verdicts_html
from dynprof.store import ArtifactStore
from dynprof.watch.html import VERDICT_FILE, verdict_html
from dynprof.watch.model import Culprit, NodeProgress, RankProgress, Verdict

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>"


def _verdict(text: str = "rank 3 on node-b is in load_batch") -> Verdict:
    return Verdict(
        kind="hang",
        job="j<1>",
        conclusion=text,
        detected_at=100.0,
        decided_at=104.5,
        culprits=[Culprit(rank=3, host=f"node-b{HOSTILE}", where=f"load_batch {HOSTILE}", why="not in the collective")],
        ranks=[{"rank": 3, "host": HOSTILE, "step": 12, "last_step_age_s": 94.0, "state": HOSTILE}],
        evidence={"stacks": {"headline": HOSTILE}},
        nodes_unanswered=[HOSTILE],
    )


def test_verdict_html_puts_the_conclusion_first_and_escapes_everything():
    # GIVEN a verdict whose every string is hostile markup
    v = _verdict(f"rank 3 {HOSTILE} hangs")

    # WHEN it is rendered
    page = verdict_html(v)

    # THEN the conclusion comes before the culprits, and no markup of the verdict survives
    assert page.index("class='conclusion'") < page.index("Culprits")
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "decided 4.5 s after detection" in page


def test_verdict_artifact_renders_through_html_renderers(dynprof_dirs):
    # GIVEN a verdict artifact in the store, as the watch writes it
    store = ArtifactStore()
    writer = store.create("verdict", job="j1")
    with writer:
        writer.write_json(VERDICT_FILE, _verdict().to_json())
        art = writer.finish("complete", summary={"kind": "hang", "conclusion": "rank 3 hangs"})

    # WHEN the page's renderer for its kind is looked up and run
    page = renderers.render_html(art)

    # THEN it is the verdict's fragment
    assert "Hang: job j&lt;1&gt;" in page and "load_batch" in page and "<script" not in page


def test_live_state_of_ranks():
    # GIVEN ranks stepping, stalled, without an agent, and not started
    def rank(pid, age, agent="up", step_time=0.1):
        return RankProgress(job="j", rank=pid, world_size=4, pid=pid, host="h", step=5, last_step_age_s=age,
                            step_time_s=step_time, agent=agent)  # fmt: skip

    ranks = [rank(1, 1.0), rank(2, 70.0), rank(3, 1.0, agent="unresponsive"), rank(4, None)]

    # WHEN their state is decided (stall after max(60 s, 20 x 0.1 s))
    limit = stall_after_s(ranks)

    # THEN each is named
    assert limit == 60.0
    assert [live_state(r, limit) for r in ranks] == ["stepping", "stalled", "agent down", "starting"]
    assert stall_after_s([rank(1, 1.0, step_time=5.0)]) == 100.0


def test_live_html_and_verdict_list_escape_hostile_names():
    # GIVEN a progress document and a verdict manifest whose strings are hostile
    progress = NodeProgress(
        host="h", time=0.0, poll_every_s=1.0,
        ranks=[RankProgress(job=HOSTILE, rank=0, world_size=1, pid=42, host=HOSTILE, step=7, last_step_age_s=2.0,
                            process_state=HOSTILE)],
    )  # fmt: skip
    item = verdict_item(f"j/{HOSTILE}/verdict/1", {"job": HOSTILE, "summary": {"conclusion": HOSTILE}}, "now", None)

    # WHEN they are rendered
    live = live_html(progress)
    listed = verdicts_html([item])

    # THEN they show as text, the rank's step and state with them
    for page in (live, listed):
        assert "<script" not in page and "<img" not in page, page
    assert re.search(r"<td class=live-step>7</td>", live) and "stepping" in live
    assert "&lt;script&gt;" in listed and "%3Cscript%3E" in listed


def _stale_ranks() -> NodeProgress:
    # two ranks of 0.1 s steps whose last step was 24 s ago
    ranks = [
        RankProgress(job="wj", rank=r, world_size=2, pid=500 + r, host="h", step=40, last_step_age_s=24.0,
                     step_time_s=0.1)
        for r in (0, 1)
    ]  # fmt: skip
    return NodeProgress(host="h", time=0.0, poll_every_s=2.0, ranks=ranks)


def test_the_page_s_live_table_uses_the_hosted_watch_s_stall_time(tmp_path):
    # GIVEN a sidecar hosting a watch with --stall-after 12 (its book's stall time), and one
    # without: ranks whose last step was 24 s ago
    from dynprof.sidecar.app import create_app
    from dynprof.sidecar.progress import ProgressBook

    pages = {}
    for given in (12.0, None):
        book = ProgressBook("h", 0.0, records=lambda: [], stall_after=given)
        app = create_app(ArtifactStore(tmp_path / "store"), progress=book)
        app.config["DYNPROF_PAGE_PROGRESS"] = _stale_ranks
        # WHEN the page is shown
        answer = app.test_client().get("/")
        assert answer.status_code == 200
        pages[given] = answer.get_data(as_text=True)

    # THEN with the watch's 12 s both ranks are stalled, as the watch says, and the rule is stated
    watched = pages[12.0]
    assert watched.count("live-state stalled'>stalled<") == 2 and "live-state stepping" not in watched
    assert watched.count("data-stall-after='12.000'") == 2
    assert "stalled: no step for 12 s" in watched
    # and without a watch's stall time, the default rule (60 s here) keeps them stepping, stated
    default = pages[None]
    assert default.count("live-state stepping'>stepping<") == 2
    assert "stalled: no step for the larger of 60 s and 20x the job's median step time here" in default
