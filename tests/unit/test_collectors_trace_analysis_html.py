"""An analysis as HTML (collectors/trace_analysis/html.py): the verdict, the breakdown chart and
one step's timeline as inline SVG, every value escaped; and the page that shows it."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from collectors.trace_analysis.html import analysis_html, breakdown_svg, render_html, timeline_svg
from collectors.trace_analysis.job import combine
from collectors.trace_analysis.rank import RankInput, analyze_ranks
from collectors.trace_analysis.reader import TraceError
from dynprof.cli import main
from dynprof.store import ArtifactStore
from tests.unit._trace_analysis_cases import copy_traces, gpu_trace

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def store_with(dynprof_dirs):
    """Copy recorded fixture artifacts into the test's store; returns the store."""
    return lambda *names: copy_traces(dynprof_dirs["artifacts"], *names)


def _gpu_analysis(tmp_path) -> dict:
    paths = [gpu_trace(tmp_path / f"r{i}.json.gz", rank=i, compute_us=4000 + 3000 * i) for i in (0, 1)]
    return combine(analyze_ranks([RankInput(str(p)) for p in paths], workers=1))


def test_artifact_page_draws_svg_charts(store_with):
    from dynprof.cli.serve import page_views
    from dynprof.sidecar.app import create_app

    store = store_with("slow1")
    assert main(["analyze", "--job", "fixture-slow1"]) == 0
    (art,) = store.list(kind="analysis")
    page = create_app(store, views=page_views()).test_client().get(f"/artifact/{art.id}").get_data(as_text=True)
    assert page.count("<svg") == 2
    assert "class='seg outside_ops'" in page and "class='lane cpu_wait'" in page
    assert "Straggler: rank 1" in page
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    # each chart is well-formed SVG (XML), with a bar per rank and a lane per rank
    svgs = [ET.fromstring(m) for m in re.findall(r"<svg.*?</svg>", page, re.S)]
    labels = [t.text for t in svgs[0].iter(SVG + "text")]
    assert "rank 0 CPU" in labels and "rank 1 CPU" in labels
    lanes = [r for r in svgs[1].iter(SVG + "rect") if "lane" in (r.get("class") or "")]
    assert lanes and all(float(r.get("width")) > 0 for r in lanes)


def test_the_breakdown_has_a_cpu_and_a_gpu_bar_per_rank_with_a_segment_per_category(tmp_path):
    svg = ET.fromstring(breakdown_svg(_gpu_analysis(tmp_path)))
    labels = [t.text for t in svg.iter(SVG + "text")]
    assert [x for x in labels if x.startswith("rank ")] == ["rank 0 CPU", "rank 0 GPU", "rank 1 CPU", "rank 1 GPU"]
    segments = [r.get("class") for r in svg.iter(SVG + "rect") if (r.get("class") or "").startswith("seg ")]
    assert segments.count("seg compute") == 2 and segments.count("seg idle") == 2


def test_the_timeline_has_a_lane_per_kind_of_work_of_each_rank(tmp_path):
    analysis = _gpu_analysis(tmp_path)
    svg = ET.fromstring(timeline_svg(analysis))
    lanes = {r.get("class") for r in svg.iter(SVG + "rect") if (r.get("class") or "").startswith("lane ")}
    assert {"lane cpu_ops", "lane gpu_compute", "lane gpu_comm", "lane gpu_memcpy"} <= lanes
    assert f"step {analysis['timeline']['step']}:" in "".join(t.text or "" for t in svg.iter(SVG + "text"))


def test_an_analysis_without_ranks_or_timeline_draws_no_chart():
    assert breakdown_svg({"ranks": []}) == "" and timeline_svg({"timeline": None}) == ""
    page = analysis_html({"ranks": [], "straggler": None, "straggler_check": "one rank only"})
    assert "No straggler." in page and "<svg" not in page


def test_values_from_a_hostile_analysis_are_escaped():
    # GIVEN an analysis whose verdict, host and figures are markup, and a lane that is not a pair
    forged = "<script>alert(1)</script>"
    analysis = {
        "ranks": [{"rank": forged, "cpu": {"ops": "<b>", "outside_ops": 3.0}, "gpu": None}],
        "straggler": {"rank": forged, "host": forged, "reason": forged},
        "straggler_check": forged,
        "timeline": {"step": forged, "ranks": [{"rank": forged, "step_ms": 2.0, "lanes": {"cpu_ops": [[0, 1], "x"]}}]},
    }
    # WHEN it is drawn THEN no markup of its own gets through
    page = analysis_html(analysis)
    assert "<script" not in page and "&lt;script&gt;" in page
    for svg in re.findall(r"<svg.*?</svg>", page, re.S):
        ET.fromstring(svg)


def test_render_html_draws_an_analysis_artifact_and_refuses_another_document(tmp_path):
    # GIVEN an analysis artifact, and an artifact whose analysis.json is not an analysis
    analysis = _gpu_analysis(tmp_path)
    good = ArtifactStore().create("analysis")
    good.write_json("analysis.json", analysis)
    bad = ArtifactStore().create("analysis")
    bad.write_json("analysis.json", {"schema": "something else"})

    # THEN the first is drawn as the page's fragment, the second is a trace error
    assert render_html(good.finish("complete")) == analysis_html(analysis)
    with pytest.raises(TraceError, match="is not a dynprof analysis"):
        render_html(bad.finish("complete"))


def test_every_category_of_the_analysis_has_a_colour_and_a_label():
    # The page draws the categories the analysis computes: a new one without its colour or label
    # would be drawn unnamed.
    from collectors.trace_analysis.html import COLORS, LABELS
    from collectors.trace_analysis.rank import CPU_CATEGORIES, GPU_CATEGORIES

    for category in (*CPU_CATEGORIES, *GPU_CATEGORIES):
        assert category in COLORS and category in LABELS, category
