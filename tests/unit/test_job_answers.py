"""dynprof/job/answers.py: the nodes' answers read as untrusted (rows of objects only, nodes
named as output names them)."""

from __future__ import annotations

from typing import Any

import pytest

from dynprof import errors
from dynprof.job import answers as job
from dynprof.nodes import Node, NodeAnswer

A, B = Node("node-a", 8787), Node("node-b", 9000)


def _answered(node: Node, result: Any) -> NodeAnswer:
    return NodeAnswer(node, True, host=node.host, exit_code=0, result=result, messages=[])


def _silent(node: Node) -> NodeAnswer:
    return NodeAnswer(node, False, error="connection refused")


def test_a_rank_key_orders_by_job_rank_node_and_pid_rankless_last():
    rows = [{"job": "j", "rank": None, "node": "a"}, {"job": "j", "rank": 1, "node": "b"}, {"job": "j", "rank": 0}]
    assert [r["rank"] for r in sorted(rows, key=job.rank_key)] == [0, 1, None]


def test_rows_keep_only_objects_of_an_answered_nodes_list():
    def agents(doc: Any) -> list[dict[str, Any]]:
        return job.answer_rows(doc, "agents", "ps")

    assert job.read(_answered(A, {"agents": [{"pid": 1}, 2, "x"]}), agents) == [{"pid": 1}]
    assert job.read(_answered(A, {"agents": "no"}), agents) is None
    assert job.read(_answered(A, {"error": {"message": "boom"}}), agents) is None
    assert job.read(_silent(A), agents) is None


def test_nodes_sharing_a_host_are_named_with_their_port():
    same = Node("node-a", 9999)
    assert job.node_labels([A, B]) == {A: "node-a", B: "node-b"}
    assert job.node_labels([A, same]) == {A: "node-a:8787", same: "node-a:9999"}


def test_answer_rows_refuse_a_document_without_its_list_and_copy_its_objects():
    doc = {"results": [{"pid": 1}, 2, None]}
    got = job.answer_rows(doc, "results", "stop")
    assert got == [{"pid": 1}] and got[0] is not doc["results"][0]
    for bad in (None, [], {"results": {"pid": 1}}, {"other": []}):
        with pytest.raises(errors.ArtifactError, match="the stop answer"):
            job.answer_rows(bad, "results", "stop")
