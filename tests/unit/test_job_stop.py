"""dynprof/job/stop.py: this node's stop of its traces (a process without a running trace is
``not-running``, no agent is an error) and the nodes' stops merged rank by rank."""

from __future__ import annotations

import json
import os

import pytest

import dynprof.agent
from dynprof import errors
from dynprof.job import stop
from dynprof.job.merge import Reach
from dynprof.node_requests import STOP_TIMEOUT_S, StopRequest
from dynprof.nodes import Node, NodeAnswer
from dynprof.sidecar.table import ACTIONS


def test_an_agent_without_a_running_trace_is_not_running_exit_1():
    dynprof.agent.start()
    got = stop.collect(StopRequest(pids=(os.getpid(),)))
    [row] = got.results
    assert got.exit_code == 1 and got.none_stopping
    assert row["pid"] == os.getpid() and row["status"] == "not-running" and row["artifact"] is None


def test_no_agent_for_the_pid_is_its_error():
    with pytest.raises(errors.NoAgent):
        stop.collect(StopRequest(pids=(os.getpid(),)))


class FakeClient:
    def __init__(self, answers: list[NodeAnswer]) -> None:
        self.answers = answers
        self.timeouts: list[float | None] = []

    def action_all(self, nodes, name, options, timeout=None):
        self.timeouts.append(timeout)
        return self.answers


def test_the_nodes_stops_merge_rank_by_rank_waiting_the_stops_default():
    a = Node("node-a", 8787)
    row = {"rank": 0, "pid": 7, "status": "complete", "artifact": "/s/t", "error": None}
    fake = FakeClient([NodeAnswer(a, True, host="node-a", exit_code=0, result={"results": [row]})])
    got = ACTIONS["stop"].job({"job": "j"}, [a], Reach(fake))  # type: ignore[misc]
    assert fake.timeouts == [STOP_TIMEOUT_S + 5.0]
    assert [(r["rank"], r["node"]) for r in got.doc["results"]] == [(0, "node-a")]
    assert got.doc["artifacts"] == [{"node": "node-a", "path": "/s/t"}] and got.exit_code == 0


def test_a_stops_answer_reads_back_what_it_wrote():
    row = {"pid": 7, "rank": 0, "status": "complete", "artifact": "/s/t", "error": None}
    answer = stop.Stopped(exit_code=1, messages=["m"], results=[row], none_stopping=True)
    doc = json.loads(json.dumps(answer.to_json()))
    assert doc == {"results": [row]}
    back = stop.Stopped.from_json(doc)
    assert back.to_json() == doc and back.rank_rows() == [row] and back.artifact_paths() == ["/s/t"]


@pytest.mark.parametrize("doc", [None, [], {}, {"results": "x"}, {"error": {"message": "no agent"}}])
def test_a_stops_answer_without_its_rows_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="stop answer"):
        stop.Stopped.from_json(doc)


def test_a_stops_rows_that_are_not_objects_are_left_out():
    assert stop.Stopped.from_json({"results": [1, "x", {"pid": 7}]}).results == [{"pid": 7}]
