"""`dynprof nccl`: its options as the kind's request, the text of this node's answer and of a
job-wide one (the flight recorders' analysis, notes, artifacts, nodes that did not answer), and
what it says where no agent is."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from collectors import flight_recorder as fr
from dynprof.cli import job, main
from dynprof.cli.nccl import NcclCommand, request_from_args
from dynprof.job import nccl as job_nccl
from dynprof.job.merge import JobResult
from dynprof.nodes import Node, NodeAnswer

DATA = Path(__file__).parent / "data"


def _analysis() -> dict[str, Any]:
    return fr.analyze({r: json.loads((DATA / f"fr_gloo_rank{r}.json").read_text()) for r in (0, 1)})


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    NcclCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


def test_options_become_the_request():
    request = request_from_args(_parse("--pid", "11,12", "--only-active", "--no-stack-traces", "--timeout", "3"))
    assert request.pids == (11, 12) and request.only_active and not request.stack_traces and request.timeout == 3.0
    assert request_from_args(_parse("--job", "j")).job == "j"


def test_a_pid_without_process_is_exit_3(capsys):
    assert main(["nccl", "--pid", "4194303"]) == 3
    assert "no process with pid 4194303" in capsys.readouterr().err


def test_text_of_this_nodes_answer():
    doc = {
        "artifact": "/s/nccl/x",
        "artifact_id": "j/h/node/nccl/x",
        "elapsed_s": 0.5,
        "analysis": _analysis(),
        "notes": ["pid 7: no dump"],
    }
    text = NcclCommand().render(JobResult(doc, 0, context={"ranks": 2, "elapsed_s": 0.5}))
    assert "HUNG: rank 0 wait in #8 gloo:all_reduce" in text
    assert "note: pid 7: no dump" in text
    assert text.endswith("2 rank(s) dumped in 0.50 s; artifact /s/nccl/x")


def test_job_wide_dumps_are_analysed_together_and_silent_nodes_named(monkeypatch, capsys):
    a, b = Node("node-a", 8787), Node("node-b", 8787)
    answers = [
        NodeAnswer(a, True, host="node-a", exit_code=0, result={"artifact": "/s/a/nccl/1"}),
        NodeAnswer(b, False, error="connection refused"),
    ]
    monkeypatch.setattr(job, "client_for", lambda args: object())

    def collect_nodes(client, nodes, request):
        assert request.job == "j" and nodes == [a, b]
        return job_nccl.NodesCollected(
            answers, {a: "node-a", b: "node-b"}, _analysis(), {0: "node-a", 1: "node-a"}, ["n1"]
        )

    monkeypatch.setattr(job_nccl, "collect_nodes", collect_nodes)
    assert main(["nccl", "--job", "j", "--hosts", "node-a,node-b"]) == 12
    captured = capsys.readouterr()
    assert "HUNG: rank 0 wait in #8" in captured.out
    assert "note: n1" in captured.out and "artifact on node-a: /s/a/nccl/1" in captured.out
    assert "2 rank(s) dumped on 1 of 2 node(s)" in captured.out
    assert "node node-b:8787: connection refused" in captured.err
    assert main(["nccl", "--job", "j", "--hosts", "node-a,node-b", "--json"]) == 12
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"] == {"0": "node-a", "1": "node-a"} and doc["recorder_off"] is False


def test_job_wide_without_any_dump_is_exit_1(monkeypatch, capsys):
    a = Node("node-a", 8787)
    answers = [NodeAnswer(a, True, host="node-a", exit_code=0, result={})]
    monkeypatch.setattr(job, "client_for", lambda args: object())
    monkeypatch.setattr(
        job_nccl, "collect_nodes", lambda c, n, r: job_nccl.NodesCollected(answers, {a: "node-a"}, None)
    )
    assert main(["nccl", "--job", "j", "--hosts", "node-a", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["analysis"] is None
