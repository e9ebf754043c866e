"""dynprof/job/ps.py: a node's ``ps`` answer (:class:`Agents`) and its codec, and the nodes'
answers merged in rank order, each read with ``Agents.from_json``."""

from __future__ import annotations

import json

import pytest

from dynprof import errors
from dynprof.job import ps
from dynprof.job.merge import Reach
from tests.support.job_answers import A, B, FakeClient, answered, silent

ROW = {"pid": 7, "role": "trainer", "rank": 1, "job": "j", "step": 3, "state": "idle", "cmdline": ["python"]}


def test_an_answer_reads_back_what_it_wrote():
    answer = ps.Agents(exit_code=8, messages=["agent of pid 7: boom"], agents=[ROW], job="j")
    doc = json.loads(json.dumps(answer.to_json()))
    assert doc == {"agents": [ROW]}
    assert ps.Agents.from_json(doc).to_json() == doc


@pytest.mark.parametrize("doc", [None, [], "agents", {}, {"agents": {"pid": 7}}, {"agents": "x" * 10_000}])
def test_an_answer_without_its_list_of_agents_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="ps answer"):
        ps.Agents.from_json(doc)


def test_rows_that_are_not_objects_are_left_out_and_the_others_copied():
    doc = {"agents": [ROW, 3, "x", None, [ROW]]}
    got = ps.Agents.from_json(doc)
    assert got.agents == [ROW]
    got.agents[0]["node"] = "node-a"
    assert "node" not in doc["agents"][0]


def test_the_nodes_agents_merge_in_rank_order_and_an_unreadable_answer_has_none():
    client = FakeClient(
        {
            A: answered(A, {"agents": [{**ROW, "rank": 2}, {**ROW, "rank": 0}]}),
            B: answered(B, {"error": {"message": "boom"}}, code=8),
        }
    )
    got = ps.collect_job({"job": "j"}, [A, B], Reach(client))  # type: ignore[arg-type]
    assert [(r["rank"], r["node"]) for r in got.doc["agents"]] == [(0, "node-a"), (2, "node-a")]
    assert got.doc["per_node"]["node-b:9000"] == {"error": {"message": "boom"}} and got.exit_code == 8
    silent_too = FakeClient({A: silent(A), B: answered(B, {"agents": []})})
    assert ps.collect_job({}, [A, B], Reach(silent_too)).doc["agents"] == []  # type: ignore[arg-type]
