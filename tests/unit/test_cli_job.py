"""dynprof/cli/job.py, the shape of every job-level command: the dispatch between this node and
the nodes, the options sent to the nodes' sidecars and the text of a job-wide answer (the merge
of the nodes' answers is dynprof/job/merge.py's: tests/unit/test_job_merge.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from dynprof import errors
from dynprof.cli import job, main
from dynprof.job.merge import JobResult
from dynprof.nodes import CommandError, NodeAnswer
from tests.support.job_answers import A, B, FakeClient, answered


def test_forward_options_sends_only_the_actions_options_that_are_set():
    args = argparse.Namespace(job="j", timeout=None, hosts="a,b", json=True)
    assert job.forward_options("ps", args) == {"job": "j"}
    assert job.forward_options("ps", args, timeout=2.0) == {"job": "j", "timeout": 2.0}


def test_answered_count_counts_the_nodes_thatanswered():
    assert job.answered_count({"nodes": [{"answered": True}, {"answered": False}, {}]}) == 1
    assert job.answered_count({}) == 0


def test_a_per_rank_answer_reads_rank_by_rank():
    result = JobResult(
        {
            "results": [
                {"rank": 0, "node": "node-b", "status": "ok", "artifact": "/s/0"},
                {"rank": 1, "node": "node-b", "status": "x"},
                {"rank": 2, "node": "node-a", "status": "ok", "artifact": "/s/2"},
            ],
            "nodes": [],
        }
    )
    command = type("Cmd", (job.JobCommand,), {"name": "stop"})()
    assert command.render(result).splitlines() == [
        "rank 0 on node-b: ok: /s/0",
        "rank 1 on node-b: x",
        "rank 2 on node-a: ok: /s/2",
    ]


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


def test_a_job_command_given_nodes_asks_their_sidecars(monkeypatch, capsys):
    fake = FakeClient(
        {
            A: answered(A, {"agents": [{"pid": 1, "rank": 1, "state": "idle"}]}),
            B: NodeAnswer(B, False, error="refused", failure=CommandError("X", "no", "", 1)),
        }
    )
    monkeypatch.setattr(job, "client_for", lambda args: fake)
    assert main(["ps", "--hosts", "node-a:8787,node-b:9000", "--job", "j", "--json"]) == 12
    doc = json.loads(capsys.readouterr().out)
    assert fake.calls[0][:3] == (["node-a:8787", "node-b:9000"], "ps", {"job": "j", "timeout": 1.0})
    assert doc["agents"] == [{"pid": 1, "rank": 1, "state": "idle", "node": "node-a"}]
