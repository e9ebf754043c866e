"""`dynprof analyze` (dynprof/cli/analyze.py) on recorded traces (tests/unit/data/traces,
recorded by tests/data/record_gloo_traces.py): the table and the artifact it saves, --json, the
ways to name traces, --compare, and its errors."""

from __future__ import annotations

import argparse
import gzip
import json

import pytest

from collectors.trace_analysis.artifact import SCHEMA_VERSION
from collectors.trace_analysis.collect import AnalysisRequest
from dynprof.cli import main
from dynprof.cli.analyze import AnalyzeCommand, request_from_args
from tests.unit._trace_analysis_cases import copy_traces


@pytest.fixture
def store_with(dynprof_dirs):
    """Copy recorded fixture artifacts into the test's store; returns the store."""
    return lambda *names: copy_traces(dynprof_dirs["artifacts"], *names)


# -- the command --------------------------------------------------------------------------------
def test_analyze_job_prints_the_table_and_saves_an_artifact(store_with, capsys):
    # GIVEN the store holds a job-wide trace group
    store = store_with("slow1")

    # WHEN the job is analysed
    rc = main(["analyze", "--job", "fixture-slow1"])

    # THEN the table has both ranks and the verdict, and an analysis artifact is saved
    out = capsys.readouterr().out
    assert rc == 0
    assert "STRAGGLER on vm: rank 1:" in out
    assert "CPU OPS" in out and "OUTSIDE" in out
    (art,) = store.list(kind="analysis")
    assert art.manifest["job"] == "fixture-slow1"
    assert art.manifest["summary"]["straggler_rank"] == 1
    assert f"saved as {art.id}" in out

    # WHEN it is shown, or given to `dynprof analyze` again
    assert main(["show", art.id]) == 0
    shown = capsys.readouterr().out
    assert main(["analyze", art.id, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)

    # THEN `dynprof show` renders the same table, and the saved analysis comes back as it was
    assert "STRAGGLER on vm: rank 1:" in shown
    assert again["artifact"] == art.id and again["straggler"]["rank"] == 1
    assert len(store.list(kind="analysis")) == 1  # printing a saved analysis saves nothing new


def test_analyze_json_schema(store_with, capsys):
    store_with("even")
    rc = main(["analyze", "--job", "fixture-even", "--json", "--top", "3", "--no-save"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["schema_version"] == SCHEMA_VERSION
    assert {"ranks", "steps", "top_kernels", "top_ops", "straggler"} <= set(data)
    assert data["straggler"] is None
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert len(data["top_ops"]) == 3
    assert data["artifact"] is None
    assert len(data["steps"]) == 3 and len(data["steps"][0]["ranks"]) == 2


def test_analyze_group_by_id_and_by_artifacts(store_with, capsys):
    store = store_with("slow1", "even")
    traces = store.list(job="fixture-slow1", kind="trace")
    group = traces[0].manifest["options"]["group_id"]
    assert main(["analyze", "--group", group[:6], "--json", "--no-save"]) == 0
    by_group = json.loads(capsys.readouterr().out)
    assert main(["analyze", *[a.id for a in traces], "--json", "--no-save"]) == 0
    by_ids = json.loads(capsys.readouterr().out)
    assert by_group["straggler"]["rank"] == by_ids["straggler"]["rank"] == 1


def test_compare_two_groups(store_with, capsys):
    # GIVEN a slow job and an even one in the store
    store = store_with("slow1", "even")
    g = {
        job: store.list(job=job, kind="trace")[0].manifest["options"]["group_id"]
        for job in ("fixture-slow1", "fixture-even")
    }

    # WHEN they are compared
    rc = main(["analyze", "--compare", g["fixture-slow1"], g["fixture-even"], "--json"])

    # THEN the step time and the time outside operators dropped, and the verdicts are given
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    cats = {c["category"]: c for c in data["categories"]}
    assert cats["step_ms"]["delta_ms"] < -20
    assert cats["cpu.collective_wait"]["delta_ms"] < -10
    assert data["straggler"]["a"]["rank"] == 1 and data["straggler"]["b"] is None
    assert data["ops"], "no operators compared"
    assert main(["analyze", "--compare", g["fixture-slow1"], g["fixture-even"]]) == 0
    assert "B-A" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["analyze"], 2, "nothing to analyse"),
        (["analyze", "--job", "nosuchjob"], 1, "no job-wide trace of job 'nosuchjob'"),
        (["analyze", "--group", "ffffff"], 1, "no trace group 'ffffff'"),
        (["analyze", "no/such/artifact"], 1, "no artifact"),
    ],
)
def test_bad_requests_get_a_clear_error(store_with, capsys, argv, code, message):
    store_with("slow1")
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_a_damaged_trace_is_reported_not_a_traceback(store_with, capsys):
    # GIVEN one rank's trace is truncated
    store = store_with("slow1")
    (victim,) = [a for a in store.list(kind="trace") if a.manifest["rank"] == 0]
    data = victim.file("trace.json.gz").read_bytes()
    victim.file("trace.json.gz").write_bytes(gzip.compress(gzip.decompress(data)[:5000]))

    # WHEN the job is analysed
    rc = main(["analyze", "--job", "fixture-slow1", "--no-save"])

    # THEN the other rank is analysed and the damaged one named in a warning
    captured = capsys.readouterr()
    assert rc == 0
    assert "1 rank(s)" in captured.out
    assert "rank 0 not analysed" in captured.err and "truncated" in captured.err


def test_traces_over_the_size_limit_are_refused_with_exit_1(store_with, capsys):
    # GIVEN a job's traces, and a decompressed-size limit below their size
    store_with("slow1")

    # WHEN the job is analysed with that limit, as JSON
    rc = main(["analyze", "--job", "fixture-slow1", "--max-trace-bytes", "10K", "--json"])

    # THEN no rank is analysed: exit 1, the reason in the JSON error and on stderr
    captured = capsys.readouterr()
    assert rc == 1
    error = json.loads(captured.out)["error"]
    assert "no trace could be analysed" in error["message"]
    assert "more than 10240 bytes once decompressed" in error["message"]
    assert "--max-trace-bytes" in captured.err


# -- the request the options make ---------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    AnalyzeCommand().prepare_parser(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--job", "j1"], AnalysisRequest(job="j1", max_bytes=7 * 1024**2)),
        (
            ["--group", "abc", "--job", "j1", "--top", "4", "--workers", "2", "--no-save"],
            AnalysisRequest(group="abc", job="j1", top=4, workers=2, max_bytes=7 * 1024**2, save=False),
        ),
        (["a1", "a2", "--max-trace-bytes", "10K"], AnalysisRequest(artifacts=("a1", "a2"), max_bytes=10 * 1024)),
        (["--compare", "g1", "g2", "--json"], AnalysisRequest(compare=("g1", "g2"), max_bytes=7 * 1024**2)),
    ],
)
def test_the_options_become_the_kind_s_request(monkeypatch, argv, expected):
    # GIVEN a trace size limit in the environment
    monkeypatch.setenv("DYNPROF_MAX_TRACE_BYTES", "7M")
    # THEN the options are the request, the limit the option's or else the environment's
    assert request_from_args(_parse(argv)) == expected


def test_with_json_the_ranks_not_analysed_are_in_the_document_not_on_stderr(store_with, capsys):
    # GIVEN one rank's trace is truncated
    store = store_with("slow1")
    (victim,) = [a for a in store.list(kind="trace") if a.manifest["rank"] == 0]
    data = victim.file("trace.json.gz").read_bytes()
    victim.file("trace.json.gz").write_bytes(gzip.compress(gzip.decompress(data)[:5000]))

    # WHEN the job is analysed as JSON
    rc = main(["analyze", "--job", "fixture-slow1", "--no-save", "--json"])

    # THEN the damaged rank is in the document's errors, and nothing is said on stderr
    captured = capsys.readouterr()
    assert rc == 0
    doc = json.loads(captured.out)
    assert [e["rank"] for e in doc["errors"]] == [0]
    assert "not analysed" not in captured.err
