"""The analysis kind's request and collection (collectors/trace_analysis/collect.py): the request
checked when made and read back from hostile JSON, and ``collect`` over a store holding the
recorded traces (tests/unit/data/traces, recorded by tests/data/record_gloo_traces.py): a job's
latest group, a group by id or prefix, trace artifacts, a saved analysis, mixed groups, the
comparison of two groups, and the errors of each."""

from __future__ import annotations

import pytest

from collectors.trace_analysis.artifact import ANALYSIS_FILE, KIND, SCHEMA_VERSION
from collectors.trace_analysis.collect import (
    Analysis,
    AnalysisRequest,
    Comparison,
    check_traces,
    collect,
    collect_comparison,
    find_group,
    group_artifacts,
    group_of,
)
from dynprof import errors
from dynprof.store import ArtifactStore
from tests.unit._trace_analysis_cases import copy_traces


@pytest.fixture
def store_with(dynprof_dirs):
    """Copy recorded fixture artifacts into the test's store; returns the store."""
    return lambda *names: copy_traces(dynprof_dirs["artifacts"], *names)


def group_id(store: ArtifactStore, job: str) -> str:
    return group_of(store.list(job=job, kind="trace")[0])


# -- the request --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "nothing to analyse"),
        ({"artifacts": ("a1",), "job": "j"}, "give either ARTIFACT... or --job/--group, not both"),
        ({"artifacts": ("a1",), "group": "g"}, "give either ARTIFACT... or --job/--group, not both"),
        ({"artifacts": ("a1",), "compare": ("a", "b")}, "give either ARTIFACT... or --compare A B, not both"),
        ({"compare": ("a",)}, "--compare takes two"),
        ({"compare": ("a", "b", "c")}, "--compare takes two"),
        ({"job": "j", "top": 0}, "--top must be 1 or more"),
        ({"job": "j", "top": 10_001}, "--top must be at most 10000"),
        ({"job": "j", "workers": -1}, "--workers must be 0 to 1024"),
        ({"job": "j", "workers": 5000}, "--workers must be 0 to 1024"),
        ({"job": "j", "max_bytes": -1}, "--max-trace-bytes must be 0 or more"),
    ],
)
def test_a_request_that_cannot_be_run_is_refused_when_made(kwargs, said):
    # WHEN a request names nothing, two ways of naming traces, or a value out of range
    with pytest.raises(errors.UsageError) as refused:
        AnalysisRequest(**kwargs)

    # THEN it is a usage error (exit 2) that says which
    assert said in refused.value.message
    assert refused.value.exit_code == 2


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"job": "j1"}, AnalysisRequest(job="j1")),
        ({"group": "abc123", "job": "j1", "top": 3}, AnalysisRequest(group="abc123", job="j1", top=3)),
        ({"artifacts": "j1/vm/rank0/trace/t1"}, AnalysisRequest(artifacts=("j1/vm/rank0/trace/t1",))),
        (
            {"compare": ["g1", "g2"], "workers": 2, "max_trace_bytes": 1024, "no_save": True},
            AnalysisRequest(compare=("g1", "g2"), workers=2, max_bytes=1024, save=False),
        ),
        ({"job": "j1", "group": None, "max_trace_bytes": None}, AnalysisRequest(job="j1")),
    ],
)
def test_a_json_document_becomes_the_request_its_options_say(doc, expected):
    assert AnalysisRequest.from_json(doc) == expected


@pytest.mark.parametrize(
    "request_",
    [
        AnalysisRequest(job="j1"),
        AnalysisRequest(artifacts=("a1", "a2"), top=25, workers=3, max_bytes=0, save=False),
        AnalysisRequest(compare=("g1", "g2"), job="j1", max_bytes=10 * 1024**3),
    ],
)
def test_a_request_reads_back_from_its_json(request_):
    assert AnalysisRequest.from_json(request_.to_json()) == request_


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        (["job", "j"], "must be a JSON object"),
        ("job=j", "must be a JSON object"),
        (None, "must be a JSON object"),
        ({"job": "j", "json": True}, "unknown option 'json'"),
        ({"job": "j", "store": "/etc"}, "unknown option 'store'"),
        ({"x" * 10_000: 1}, "unknown option 'xxxx"),
        ({"job": ["j"]}, "'job' must be a string"),
        ({"job": "j\x00k"}, "without NUL"),
        ({"group": "g" * 5000}, "at most 4096 characters"),
        ({"artifacts": ["a"] * 2000}, "a list of 1 to 1024 items"),
        ({"artifacts": []}, "a list of 1 to 1024 items"),
        ({"artifacts": [1, 2]}, "a list of strings"),
        ({"compare": ["g1"]}, "--compare takes two"),
        ({"compare": ["g1", "g2", "g3"]}, "--compare takes two"),
        ({"compare": "g1"}, "--compare takes two"),
        ({"job": "j", "top": "10"}, "'top' must be an integer"),
        ({"job": "j", "top": True}, "'top' must be an integer"),
        ({"job": "j", "top": 1.5}, "'top' must be an integer"),
        ({"job": "j", "top": 10**400}, "--top must be at most 10000"),
        ({"job": "j", "top": -3}, "--top must be 1 or more"),
        ({"job": "j", "workers": 10**6}, "--workers must be 0 to 1024"),
        ({"job": "j", "max_trace_bytes": -1}, "--max-trace-bytes must be 0 or more"),
        ({"job": "j", "max_trace_bytes": "2G"}, "'max_trace_bytes' must be an integer"),
        ({"job": "j", "no_save": "yes"}, "true or false"),
        ({}, "nothing to analyse"),
    ],
)
def test_a_hostile_document_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        AnalysisRequest.from_json(doc)
    assert said in refused.value.message


def test_the_trace_limit_is_the_request_s_else_the_environment_s(monkeypatch):
    monkeypatch.setenv("DYNPROF_MAX_TRACE_BYTES", "3M")
    assert AnalysisRequest(job="j").trace_limit() == 3 * 1024**2
    assert AnalysisRequest(job="j", max_bytes=0).trace_limit() == 0
    assert AnalysisRequest(job="j", max_bytes=5000).trace_limit() == 5000


# -- collecting ---------------------------------------------------------------------------------
def test_a_job_s_latest_group_is_analysed_and_saved(store_with):
    # GIVEN the store holds a job-wide trace group of a job with a slow rank
    store = store_with("slow1")

    # WHEN the job is analysed
    got = collect(AnalysisRequest(job="fixture-slow1", workers=1, top=3), store)

    # THEN every rank is analysed, rank 1 is the straggler, and the analysis is saved as an artifact
    assert isinstance(got, Analysis)
    assert [r["rank"] for r in got.data["ranks"]] == [0, 1]
    assert got.data["straggler"]["rank"] == 1
    assert got.data["schema_version"] == SCHEMA_VERSION
    assert got.label == f"job fixture-slow1, group {group_id(store, 'fixture-slow1')}"
    assert got.messages == [] and got.exit_code == 0 and not got.loaded
    (art,) = store.list(kind=KIND)
    assert got.saved is not None and got.saved.id == art.id
    assert art.manifest["job"] == "fixture-slow1"
    assert art.manifest["options"]["group_id"] == group_id(store, "fixture-slow1")
    assert sorted(art.manifest["options"]["sources"]) == sorted(a.id for a in store.list(kind="trace"))
    assert art.manifest["summary"]["straggler_rank"] == 1 and art.manifest["summary"]["ranks"] == 2
    assert art.has_file(ANALYSIS_FILE)

    # AND its JSON cuts the tables to `top` rows and names the artifact
    doc = got.to_json()
    assert len(doc["top_ops"]) == 3 and len(got.data["top_ops"]) > 3
    assert doc["artifact"] == art.id


def test_a_saved_analysis_is_read_back_as_it_was_and_nothing_new_is_saved(store_with):
    store = store_with("slow1")
    first = collect(AnalysisRequest(job="fixture-slow1", workers=1), store)
    assert isinstance(first, Analysis) and first.saved is not None

    again = collect(AnalysisRequest(artifacts=(first.saved.id,)), store)

    assert isinstance(again, Analysis) and again.loaded
    assert again.label == f"saved analysis {first.saved.id}"
    assert again.data["straggler"] == first.data["straggler"]
    assert again.to_json()["artifact"] == first.saved.id
    assert len(store.list(kind=KIND)) == 1


def test_without_save_nothing_is_written(store_with):
    store = store_with("even")
    got = collect(AnalysisRequest(job="fixture-even", workers=1, save=False), store)
    assert isinstance(got, Analysis)
    assert got.saved is None and got.to_json()["artifact"] is None
    assert got.data["straggler"] is None
    assert store.list(kind=KIND) == []


def test_a_group_is_found_by_its_id_or_a_prefix_and_by_its_artifacts(store_with):
    store = store_with("slow1", "even")
    group = group_id(store, "fixture-slow1")
    traces = store.list(job="fixture-slow1", kind="trace")

    by_prefix = collect(AnalysisRequest(group=group[:6], workers=1, save=False), store)
    by_ids = collect(AnalysisRequest(artifacts=tuple(a.id for a in traces), workers=1, save=False), store)

    assert isinstance(by_prefix, Analysis) and isinstance(by_ids, Analysis)
    assert by_prefix.data["straggler"]["rank"] == by_ids.data["straggler"]["rank"] == 1
    assert {s["artifact"] for s in by_prefix.data["sources"]} == {a.id for a in traces}
    assert by_ids.label == ", ".join(a.id for a in traces)


def test_traces_of_mixed_groups_are_analysed_together_and_saved_without_a_job_or_group(store_with):
    # GIVEN the traces of two jobs' groups
    store = store_with("slow1", "even")
    traces = store.list(kind="trace")
    assert len({group_of(a) for a in traces}) == 2

    # WHEN all of them are given as artifacts
    got = collect(AnalysisRequest(artifacts=tuple(a.id for a in traces), workers=1), store)

    # THEN every trace is read, and the saved analysis names its sources but neither job nor group
    assert isinstance(got, Analysis)
    assert {s["group_id"] for s in got.data["sources"]} == {group_of(a) for a in traces}
    assert len(got.data["sources"]) == 4
    (art,) = store.list(kind=KIND)
    assert art.manifest["job"] is None
    assert art.manifest["options"]["group_id"] is None
    assert sorted(art.manifest["options"]["sources"]) == sorted(a.id for a in traces)


def test_group_lookups_and_their_errors(store_with):
    store = store_with("slow1", "even")

    # a prefix that matches two groups is refused, naming how many
    with pytest.raises(errors.DynprofError, match="matches 2 trace groups"):
        group_artifacts(store, "")
    # a group not in the store, or not in the job named, is no group
    assert group_artifacts(store, "ffffffffffff") == []
    with pytest.raises(errors.DynprofError, match="no trace group 'ffffff'"):
        find_group(store, None, "ffffff")
    with pytest.raises(errors.DynprofError, match="in job 'fixture-even'"):
        find_group(store, "fixture-even", group_id(store, "fixture-slow1"))
    # a job without a job-wide trace is said with where it was looked for
    with pytest.raises(errors.DynprofError) as none:
        find_group(store, "nosuchjob", None)
    assert "no job-wide trace of job 'nosuchjob'" in none.value.message
    assert str(store.root) in none.value.message
    # without a group, a job's latest group
    assert {a.id for a in find_group(store, "fixture-even", None)} == {
        a.id for a in store.list(job="fixture-even", kind="trace")
    }


@pytest.mark.parametrize(
    ("request_", "error", "said"),
    [
        (AnalysisRequest(job="nosuchjob"), errors.DynprofError, "no job-wide trace of job 'nosuchjob'"),
        (AnalysisRequest(group="ffffff"), errors.DynprofError, "no trace group 'ffffff'"),
        (AnalysisRequest(artifacts=("no/such/artifact",)), errors.DynprofError, "no artifact"),
        (AnalysisRequest(job="fixture-slow1", max_bytes=10 * 1024), errors.DynprofError, "no trace could be analysed"),
    ],
)
def test_what_cannot_be_analysed_is_an_error_that_says_why(store_with, request_, error, said):
    store = store_with("slow1")
    with pytest.raises(error) as failed:
        collect(request_, store)
    assert said in failed.value.message
    assert store.list(kind=KIND) == []


def test_an_artifact_that_is_not_a_trace_is_a_usage_error(store_with):
    store = store_with("slow1")
    saved = collect(AnalysisRequest(job="fixture-slow1", workers=1), store)
    assert isinstance(saved, Analysis) and saved.saved is not None
    trace = store.list(kind="trace")[0]

    with pytest.raises(errors.UsageError, match=f"{saved.saved.id} is a {KIND} artifact, not a trace"):
        collect(AnalysisRequest(artifacts=(trace.id, saved.saved.id), workers=1), store)


def test_one_trace_per_rank_the_newest(store_with):
    store = store_with("slow1")
    traces = store.list(kind="trace")
    # the same artifacts given twice are read once each
    kept = check_traces(traces + traces)
    assert sorted(a.id for a in kept) == sorted(a.id for a in traces)


def test_a_damaged_rank_is_a_warning_and_the_others_are_analysed(store_with):
    import gzip

    store = store_with("slow1")
    (victim,) = [a for a in store.list(kind="trace") if a.manifest["rank"] == 0]
    raw = victim.file("trace.json.gz").read_bytes()
    victim.file("trace.json.gz").write_bytes(gzip.compress(gzip.decompress(raw)[:5000]))

    got = collect(AnalysisRequest(job="fixture-slow1", workers=1, save=False), store)

    assert isinstance(got, Analysis)
    assert [r["rank"] for r in got.data["ranks"]] == [1]
    assert len(got.messages) == 1
    assert got.messages[0].startswith("warning: rank 0 not analysed:") and "truncated" in got.messages[0]


# -- comparing ----------------------------------------------------------------------------------
def test_two_groups_are_compared_b_minus_a(store_with):
    store = store_with("slow1", "even")
    a, b = group_id(store, "fixture-slow1"), group_id(store, "fixture-even")

    got = collect(AnalysisRequest(compare=(a, b), workers=1), store)

    assert isinstance(got, Comparison)
    assert (got.a_label, got.b_label) == (f"group {a}", f"group {b}")
    cats = {c["category"]: c for c in got.comparison["categories"]}
    assert cats["step_ms"]["delta_ms"] < -20
    assert got.comparison["straggler"]["a"]["rank"] == 1 and got.comparison["straggler"]["b"] is None
    doc = got.to_json()
    assert doc["a"] == {"label": f"group {a}"} and doc["b"] == {"label": f"group {b}"}
    assert store.list(kind=KIND) == []  # a comparison saves nothing


def test_a_side_may_be_a_trace_or_a_saved_analysis(store_with):
    store = store_with("slow1", "even")
    saved = collect(AnalysisRequest(job="fixture-slow1", workers=1), store)
    assert isinstance(saved, Analysis) and saved.saved is not None
    trace = store.list(job="fixture-even", kind="trace")[0]

    got = collect_comparison(AnalysisRequest(compare=(saved.saved.id, trace.id), workers=1), store)

    assert (got.a_label, got.b_label) == (f"analysis {saved.saved.id}", f"trace {trace.id}")
    assert got.comparison["straggler"]["a"]["rank"] == 1


def test_a_side_that_is_nothing_is_an_error(store_with):
    store = store_with("slow1")
    with pytest.raises(errors.DynprofError, match="no artifact"):
        collect(AnalysisRequest(compare=(group_id(store, "fixture-slow1"), "no/such/artifact"), workers=1), store)
    with pytest.raises(errors.DynprofError, match=r"no trace of .* could be analysed"):
        collect(AnalysisRequest(compare=(group_id(store, "fixture-slow1"),) * 2, max_bytes=1024, workers=1), store)


def test_a_request_without_compare_has_nothing_to_compare(store_with):
    with pytest.raises(errors.UsageError, match="nothing to compare"):
        collect_comparison(AnalysisRequest(job="j"), store_with())
