"""The memory plan's text (collectors.memory.plan.render_text) from an untrusted artifact: in
`dynprof show` and on the sidecar's page, no string of it forges a line or reaches the terminal
raw; a saving beyond the peak is refused, not printed as a negative budget."""

from __future__ import annotations

import html

import pytest

from collectors.memory.collect import MemoryPlanRequest
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.render import KIND, PLAN_FILE, render_artifact
from collectors.memory.plan.solve import make_plan
from dynprof import errors
from dynprof.cli import main
from dynprof.cli.serve import page_views
from dynprof.sidecar.app import create_app
from dynprof.store import ArtifactStore
from tests.support.scripts import load_script

# What a hostile node puts in every string: a newline that would start a line of its own, a
# carriage return, a terminal escape, a bidirectional override, a line separator.
FORGED = "\nFORGED line\r\nFORGED crlf\x1b[2J\u202e\u2028FORGED sep"


def forged_plan() -> dict:
    """plan.json of 6 equal blocks, every string of it forged."""
    doc = load_script("bench_plan_solver").craft(6, alike=True)
    m = doc["measurement"]
    m["device"] = "cuda:0" + FORGED
    m["peak_source"] = "allocator" + FORGED
    m["notes"] = ["a note" + FORGED, FORGED]
    m["error"] = "err" + FORGED
    for b in m["blocks"]:
        b["name"] += FORGED
        b["class"] += FORGED
    return doc


def store_plan(store: ArtifactStore, doc: dict) -> str:
    w = store.create(KIND, job="j1", rank=0, pid=7)
    w.write_json(PLAN_FILE, doc)
    return w.finish("complete", summary=doc["asked"]).id


def assert_no_forged_line(text: str) -> None:
    assert "FORGED" in text  # the strings are there, escaped
    for line in text.splitlines():
        assert not line.lstrip().startswith("FORGED"), line
    assert not any(ch in text for ch in "\r\x1b\u202e\u2028")


def test_every_string_of_the_measurement_is_one_line_in_the_plans_text():
    # GIVEN a plan.json whose every string holds newlines and escapes
    doc = forged_plan()
    # WHEN its text is rendered (as `dynprof show` and the page do)
    summary, text = render_artifact(_Stored(doc))
    # THEN the plan is there, and no string made a line of its own or reached it raw
    assert summary["status"] == "fits" and "plan: checkpoint" in text
    assert_no_forged_line(text)
    assert text.startswith("measured step on cuda:0\\nFORGED line\\r\\nFORGED crlf\\x1b")


def test_dynprof_show_of_a_forged_plan_prints_no_forged_line(capsys):
    # GIVEN a stored memory-plan artifact, every string forged
    art_id = store_plan(ArtifactStore(), forged_plan())
    # WHEN `dynprof show` prints it
    assert main(["show", art_id]) == 0
    out = capsys.readouterr().out
    # THEN every line is dynprof's own
    assert "plan: checkpoint" in out
    assert_no_forged_line(out)


def test_the_sidecars_page_of_a_forged_plan_shows_no_forged_line(tmp_path):
    # GIVEN the same artifact in a sidecar's store
    store = ArtifactStore(tmp_path / "store")
    art_id = store_plan(store, forged_plan())
    # WHEN its page is asked for
    page = create_app(store, views=page_views()).test_client().get(f"/artifact/{art_id}").get_data(as_text=True)
    # THEN its contents hold the plan, and no string of the artifact forged a line of them
    contents = html.unescape(page.split("<h2>Contents</h2><pre>", 1)[1].split("</pre>", 1)[0])
    assert "plan: checkpoint" in contents
    assert_no_forged_line(contents)


class _Stored:
    def __init__(self, doc: dict) -> None:
        self.doc = doc

    def read_json(self, name: str, limit: int) -> dict:
        return self.doc


def test_a_saving_beyond_the_measured_peak_is_a_usage_error_not_a_negative_budget():
    # GIVEN a measurement, and a request to save more than its whole peak
    doc = forged_plan()
    m = from_json(doc["measurement"])
    request = MemoryPlanRequest(pids=(1,), save="999999999999T")
    # WHEN it is planned THEN it is refused as bad input (exit 2), saying the peak
    with pytest.raises(errors.UsageError) as refused:
        request.plan(doc["measurement"])
    assert refused.value.exit_code == 2
    assert "more than the measured step's peak" in refused.value.message
    # AND a saving of the whole peak is still a plan (of the floor, or none), never negative
    whole = make_plan(m, save=m.peak_bytes)
    assert whole["budget_bytes"] == 0 and whole["status"] == "unreachable"
    with pytest.raises(ValueError):
        make_plan(m, save=m.peak_bytes + 1)
    # AND a stored plan asking it is refused by `dynprof show` with the reason
    doc["asked"] = {"save_bytes": m.peak_bytes + 1}
    with pytest.raises(errors.ArtifactError, match="more than its measured peak"):
        render_artifact(_Stored(doc))


@pytest.mark.parametrize(
    ("timed_steps", "said"),
    [(3, "recompute times from the blocks' forward in 3 plain steps"), (0, "recompute times from the measured step")],
)
def test_the_plans_text_says_where_its_recompute_times_come_from(timed_steps, said):
    doc = load_script("bench_plan_solver").craft(6, alike=True)
    doc["measurement"]["timed_steps"] = timed_steps
    _summary, text = render_artifact(_Stored(doc))
    assert said in text
