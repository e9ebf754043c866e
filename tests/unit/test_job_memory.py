"""dynprof/job/memory.py: a node's snapshots answer (:class:`MemoryResults`) and plans answer
(:class:`MemoryPlanResults`) with their codecs, and the nodes' snapshots merged rank by rank."""

from __future__ import annotations

import json

import pytest

from collectors.memory.collect import DEFAULT_TIMEOUT_S
from dynprof import errors
from dynprof.job import memory
from dynprof.job.merge import Reach
from dynprof.sidecar.table import ACTIONS
from tests.support.job_answers import A, B, FakeClient, answered

ROW = {"pid": 7, "rank": 0, "status": "ok", "artifact": "/s/m", "error": None, "summary": {"allocated_bytes": 5}}
PLAN_ROW = {"pid": 7, "rank": 0, "status": "ok", "plan": {"blocks": []}, "artifact": None}


def _round_trip(answer):
    doc = json.loads(json.dumps(answer.to_json()))
    return doc, type(answer).from_json(doc)


def test_a_snapshots_answer_reads_back_what_it_wrote():
    doc, back = _round_trip(memory.MemoryResults(exit_code=1, results=[ROW], history=True))
    assert doc == {"results": [ROW]} and back.to_json() == doc
    assert back.rank_rows() == [ROW] and back.artifact_paths() == ["/s/m"]


def test_a_plans_answer_reads_back_what_it_wrote():
    job = {"job": "j", "ranks": [0], "pids": [7]}
    answer = memory.MemoryPlanResults(messages=["n"], results=[PLAN_ROW], jobs=[job], notes=["n"])
    doc, back = _round_trip(answer)
    assert doc == {"schema": 1, "results": [PLAN_ROW], "jobs": [job], "notes": ["n"]}
    assert back.to_json() == doc and back.messages == ["n"]


@pytest.mark.parametrize("doc", [None, 7, {}, {"results": {"pid": 7}}, {"results": None}])
def test_a_snapshots_answer_without_its_rows_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="memory answer"):
        memory.MemoryResults.from_json(doc)


@pytest.mark.parametrize(
    "doc",
    [
        "x",
        {"schema": 1},
        {"schema": 1, "results": "x"},
        {"results": []},
        {"schema": 2, "results": []},
        {"schema": True, "results": []},
        {"schema": "1", "results": []},
    ],
)
def test_a_plans_answer_of_another_schema_or_without_its_rows_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="memory plan answer"):
        memory.MemoryPlanResults.from_json(doc)


def test_a_plans_answer_keeps_only_objects_and_bounds_each_note():
    doc = {"schema": 1, "results": [PLAN_ROW, 3], "jobs": [{"job": "j"}, "x"], "notes": ["n" * 10_000, 5]}
    got = memory.MemoryPlanResults.from_json(doc)
    assert got.results == [PLAN_ROW] and got.jobs == [{"job": "j"}]
    assert [len(n) for n in got.notes] == [memory.MAX_NOTE_CHARS, 1] and got.messages == got.notes
    assert memory.MemoryPlanResults.from_json({"schema": 1, "results": [], "jobs": {}, "notes": "x"}).notes == []


def test_the_nodes_snapshots_merge_rank_by_rank_each_read_by_the_kinds_decoder():
    client = FakeClient(
        {
            A: answered(A, {"results": [{**ROW, "rank": 1, "artifact": "/s/1"}, "junk"]}),
            B: answered(B, {"results": "junk"}, code=1),
        }
    )
    got = ACTIONS["memory"].job({"job": "j"}, [A, B], Reach(client))  # type: ignore[misc]
    assert [(r["rank"], r["node"]) for r in got.doc["results"]] == [(1, "node-a")]
    assert got.doc["artifacts"] == [{"node": "node-a", "path": "/s/1"}] and got.exit_code == 1
    assert client.calls[0][3] == DEFAULT_TIMEOUT_S + 5.0
