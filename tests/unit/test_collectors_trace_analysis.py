"""The package collectors.trace_analysis keeps the names its callers imported when it was one
module: each is the object of the module that owns it (reader, intervals, rank, job, artifact,
render, html)."""

from __future__ import annotations

import importlib

import pytest

import collectors.trace_analysis as ta

OWNERS = {
    "reader": ["DEFAULT_MAX_TRACE_BYTES", "MAX_VALUE_CHARS", "TraceError", "iter_trace"],
    "intervals": ["Cover"],
    "rank": [
        "CPU_CATEGORIES",
        "GPU_CATEGORIES",
        "MAX_DURATION_US",
        "MAX_TIMESTAMP_US",
        "TIMELINE_SEGMENTS",
        "TIMELINE_STEPS",
        "RankInput",
        "analyze_rank",
        "analyze_ranks",
        "default_workers",
        "device_of",
        "is_comm_kernel",
        "is_comm_op",
        "profiler_step_number",
    ],
    "job": [
        "COPY_BYTES_TOLERANCE",
        "NOISE_FLOOR_MS",
        "NOISE_FRACTION",
        "WORK_COUNT_TOLERANCE",
        "category_means",
        "combine",
        "compare",
        "detect_straggler",
        "short_collective",
        "short_function",
    ],
    "artifact": ["ANALYSIS_FILE", "KIND", "MAX_ANALYSIS_FILE_BYTES", "SCHEMA", "SCHEMA_VERSION", "load_analysis"],
    "render": ["render_artifact", "render_compare_text", "render_text"],
    "html": ["render_html"],
}


@pytest.mark.parametrize("module", sorted(OWNERS))
def test_the_package_exports_each_name_of_the_module_that_owns_it(module):
    owner = importlib.import_module(f"collectors.trace_analysis.{module}")
    for name in OWNERS[module]:
        assert getattr(ta, name) is getattr(owner, name), name
        obj = getattr(owner, name)
        if callable(obj):
            assert obj.__module__ == owner.__name__, name  # defined there, not imported


def test_the_package_exports_what_it_says_and_nothing_else():
    assert sorted(ta.__all__) == sorted(name for names in OWNERS.values() for name in names)


def test_the_renderers_of_an_analysis_artifact_are_found_where_they_are_defined():
    from dynprof.renderers import HTML_RENDERERS, RENDERERS

    for table, owner in ((RENDERERS, "render"), (HTML_RENDERERS, "html")):
        module, function = table["analysis"].split(":")
        assert module == f"collectors.trace_analysis.{owner}"
        assert getattr(importlib.import_module(module), function) is getattr(ta, function)
