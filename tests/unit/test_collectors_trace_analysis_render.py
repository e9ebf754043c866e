"""An analysis as text (collectors/trace_analysis/render.py): the per-rank table, the verdict,
the top tables, a comparison, an artifact's summary; each line one printable line."""

from __future__ import annotations

import pytest

from collectors.trace_analysis.job import compare
from collectors.trace_analysis.reader import TraceError
from collectors.trace_analysis.render import render_artifact, render_compare_text, render_text
from dynprof.store import ArtifactStore
from tests.unit._trace_analysis_cases import analyze


def test_the_text_of_an_analysis_has_a_row_per_rank_and_the_verdict():
    analysis = analyze("slow1")
    lines = render_text(analysis).splitlines()
    assert lines[0].startswith("2 rank(s), steps ") and lines[0].endswith("CPU-only traces")
    assert "backend gloo" in lines[0]
    head = next(i for i, line in enumerate(lines) if line.startswith("RANK"))
    assert "CPU OPS" in lines[head] and "COMPUTE" not in lines[head]  # no GPU columns in CPU-only traces
    assert [line.split()[0] for line in lines[head + 1 : head + 3]] == ["0", "1"]
    assert any(line.startswith("STRAGGLER on vm: rank 1:") for line in lines)
    assert f"({analysis['straggler_check']})" in lines
    assert any(line.startswith("top CPU operators (self time)") for line in lines)


def test_top_limits_the_rows_of_the_top_tables():
    analysis = analyze("slow1")
    lines = render_text(analysis, top=2).splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("top CPU operators"))
    assert len(lines[title + 1 :]) == 2


def test_numbers_too_wide_or_not_numbers_keep_the_columns_and_ranks_not_analysed_are_named():
    # GIVEN a rank whose figures are huge, NaN or missing, and a rank not analysed whose error
    # holds a line break
    cpu = {"ops": 1e300, "collective": float("nan"), "collective_wait": None, "outside_ops": 1.25}
    analysis = {
        "ranks": [{"rank": 0, "host": "h", "step_ms": 12.345, "cpu": cpu, "gpu": None}],
        "errors": [{"rank": 1, "error": "bad\nSTRAGGLER on forged"}],
    }
    lines = render_text(analysis).splitlines()
    row = next(line for line in lines if line.startswith("   0 h"))
    assert row.split() == ["0", "h", "12.3", "|", "1e+300", "-", "-", "1.2"]
    assert lines[-1].startswith("not analysed: rank 1: bad") and not any(x.startswith("STRAGGLER") for x in lines)


def test_the_text_of_a_comparison_has_a_row_per_category_and_both_verdicts():
    a, b = analyze("slow1"), analyze("even")
    text = render_compare_text(compare(a, b), "slow", "even")
    lines = text.splitlines()
    assert lines[:2] == ["A = slow", "B = even"]
    assert any(line.startswith("step_ms ") for line in lines)
    assert lines[-2].startswith("straggler in A: rank 1:") and lines[-1] == "straggler in B: none"
    assert "CPU operators that moved most (ms/step/rank)" in text


def test_an_analysis_artifact_s_summary_is_its_verdict_and_its_text():
    analysis = analyze("slow1")
    writer = ArtifactStore().create("analysis")
    writer.write_json("analysis.json", analysis)
    summary, text = render_artifact(writer.finish("complete"))
    assert set(summary) == {"ranks", "common_steps", "straggler", "straggler_check"}
    assert summary["straggler"]["rank"] == 1 and summary["common_steps"] == analysis["common_steps"]
    assert text == render_text(analysis)


def test_an_artifact_without_an_analysis_is_a_trace_error():
    writer = ArtifactStore().create("analysis")
    writer.write_json("other.json", {})
    with pytest.raises(TraceError):
        render_artifact(writer.finish("complete"))
