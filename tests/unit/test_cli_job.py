"""dynprof/cli/job.py, the shape of every job-level command: the dispatch between this node and
the nodes, the options sent to the nodes' sidecars, the merge of their answers (exit code,
messages, per-node envelope, per-rank rows) and the text of a job-wide answer."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from dynprof import errors
from dynprof.cli import job, main
from dynprof.nodes import CommandError, Node, NodeAnswer

A, B = Node("node-a", 8787), Node("node-b", 9000)


def _answered(node: Node, result: Any, code: int = 0, messages: list[str] | None = None) -> NodeAnswer:
    return NodeAnswer(node, True, host=node.host, exit_code=code, result=result, messages=messages or [])


def _silent(node: Node, error: str = "connection refused") -> NodeAnswer:
    return NodeAnswer(node, False, error=error)


class FakeClient:
    """The sidecars' client: each node answers what ``answers`` holds for it."""

    def __init__(self, answers: dict[Node, NodeAnswer]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str, dict[str, Any], float | None]] = []

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        self.calls.append(([n.address for n in nodes], name, dict(options), timeout))
        return [self.answers[n] for n in nodes]


def test_exit_code_is_12_when_a_node_is_silent_else_the_highest():
    assert job.exit_code([]) == 0
    assert job.exit_code([_answered(A, {}), _answered(B, {}, code=8)]) == 8
    assert job.exit_code([_answered(A, {}, code=8), _silent(B)]) == job.NODES_FAILED_EXIT == 12


def test_a_failed_fetch_makes_a_success_exit_1_only():
    assert job.with_fetch(0, None) == 0
    assert job.with_fetch(0, [{"error": None}]) == 0
    assert job.with_fetch(0, [{"error": None}, {"error": "gone"}]) == 1
    assert job.with_fetch(8, [{"error": "gone"}]) == 8


def test_node_messages_name_each_node_bounded_and_escaped():
    many = [f"dynprof: line {i}" for i in range(job.MAX_MESSAGES_SHOWN + 3)]
    out = job.node_messages([_silent(A, "timed out\x1b[2J"), _answered(B, {}, messages=many), _answered(A, {}, code=5)])
    assert out[0].startswith("node node-a:8787: timed out") and "\x1b" not in out[0]
    assert out[1] == "node node-b:9000: line 0"  # the node's own prefix is not repeated
    assert out[job.MAX_MESSAGES_SHOWN + 1] == "node node-b:9000: ... 3 more line(s)"
    assert out[-1] == "node node-a:8787: exit 5"


def test_envelope_keeps_each_nodes_answer_without_the_merged_lists():
    doc = job.envelope([_answered(A, {"agents": [1], "kept": True}), _silent(B)], strip=("agents",))
    assert doc["per_node"] == {"node-a:8787": {"kept": True}, "node-b:9000": None}
    assert [n["node"] for n in doc["nodes"]] == ["node-a:8787", "node-b:9000"]
    assert [n["answered"] for n in doc["nodes"]] == [True, False]
    assert job.answered_count(doc) == 1


def test_forward_options_sends_only_the_actions_options_that_are_set():
    args = argparse.Namespace(job="j", timeout=None, hosts="a,b", json=True)
    assert job.forward_options("ps", args) == {"job": "j"}
    assert job.forward_options("ps", args, timeout=2.0) == {"job": "j", "timeout": 2.0}


def test_artifacts_of_lists_the_paths_of_answered_nodes():
    answers = [_answered(A, {"paths": ["/s/1", "", 7]}), _silent(B)]
    rows = job.artifacts_of(answers, {A: "node-a", B: "node-b"}, lambda r: r["paths"])
    assert rows == [{"node": "node-a", "node_address": "node-a:8787", "path": "/s/1"}]


def test_who_is_the_rank_else_the_pid():
    assert job.who({"rank": 0, "pid": 9}) == "rank 0"
    assert job.who({"rank": None, "pid": 9}) == "pid 9"


def test_the_footer_names_silent_and_cut_nodes():
    text = job.Text()
    text.footer(
        {
            "nodes": [
                {"node": "a:1", "answered": True},
                {"node": "b:1", "answered": False, "error": "refused"},
                {"node": "c:1", "answered": False, "cut": True},
            ]
        }
    )
    out = text.value()
    assert "1 of 3 node(s) cut" in out and "  c:1" in out
    assert "1 of 3 node(s) did not answer:\n  b:1: refused" in out


def test_text_artifacts_says_what_was_fetched_and_what_not():
    text = job.Text()
    text.artifacts(
        [{"node": "a", "path": "/s/x"}],
        [
            {"id": "i1", "node": "a", "error": None, "files": 2, "path": "/here/i1"},
            {"id": "i2", "node": "b", "error": "gone", "files": 0, "path": None},
        ],
    )
    assert text.value().splitlines() == [
        "artifact on a: /s/x",
        "fetched 2 file(s) of i1 from a into /here/i1",
        "NOT FETCHED i2 from b: gone",
    ]


def test_the_client_needs_a_token_file(monkeypatch):
    monkeypatch.delenv("DYNPROF_TOKEN_FILE", raising=False)
    args = argparse.Namespace(token_file=None, cacert=None, node_timeout=1.0, max_in_flight=4)
    with pytest.raises(errors.UsageError, match="need their access token"):
        job.client_for(args)


def test_per_rank_rows_merge_in_rank_order_with_their_node():
    answers = [
        _answered(A, {"results": [{"rank": 2, "status": "ok", "artifact": "/s/2"}]}),
        _answered(B, {"results": [{"rank": 0, "status": "ok", "artifact": "/s/0"}, {"rank": 1, "status": "x"}]}),
    ]
    args = argparse.Namespace(fetch=None, job=None)
    result = job.per_rank_result(args, FakeClient({}), [A, B], answers, ("results",))  # type: ignore[arg-type]
    assert [(r["rank"], r["node"]) for r in result.doc["results"]] == [(0, "node-b"), (1, "node-b"), (2, "node-a")]
    assert [a["path"] for a in result.doc["artifacts"]] == ["/s/2", "/s/0"]
    assert result.exit_code == 0 and result.doc["per_node"]["node-a:8787"] == {}
    command = type("Cmd", (job.JobCommand,), {"name": "stop"})()
    assert command.render(result).splitlines() == [
        "rank 0 on node-b: ok: /s/0",
        "rank 1 on node-b: x",
        "rank 2 on node-a: ok: /s/2",
    ]


def test_a_job_command_given_nodes_asks_their_sidecars(monkeypatch, capsys):
    fake = FakeClient(
        {
            A: _answered(A, {"agents": [{"pid": 1, "rank": 1, "state": "idle"}]}),
            B: NodeAnswer(B, False, error="refused", failure=CommandError("X", "no", "", 1)),
        }
    )
    monkeypatch.setattr(job, "client_for", lambda args: fake)
    assert main(["ps", "--hosts", "node-a:8787,node-b:9000", "--job", "j", "--json"]) == 12
    doc = json.loads(capsys.readouterr().out)
    assert fake.calls[0][:3] == (["node-a:8787", "node-b:9000"], "ps", {"job": "j", "timeout": 1.0})
    assert doc["agents"] == [{"pid": 1, "rank": 1, "state": "idle", "node": "node-a"}]
