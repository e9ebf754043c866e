"""dynprof.cli.start: `dynprof start`. Its options and their usage errors, the trace kind's request
they make, this node's start (the kind's collect replaced) and its text, and over nodes (a fake
sidecar client): the selection it needs, the duration and open-ended start sent as they are, the
steps start's document and exit code, and the text of both. The planning of one step for every
node is tested in test_fanout_commands.py."""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.torch_trace.collect import Started, TraceRequest
from dynprof import errors
from dynprof.cli import _common, job, main
from dynprof.cli import start as start_cli
from dynprof.job import start as job_start
from dynprof.job.merge import JobResult
from dynprof.nodes import Node, NodeAnswer

GROUP = "sample-0123456789ab"
ESC = "\x1b[2J"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynprof start")
    start_cli.StartCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


# -- option types ----------------------------------------------------------------------------------
def test_sample_groups_are_a_comma_list_of_sample_names():
    assert start_cli._sample_groups(f" {GROUP} ,,sample-ffffffffffff") == [GROUP, "sample-ffffffffffff"]
    assert start_cli._sample_groups("") == []


@pytest.mark.parametrize(
    "text",
    ["sample-0123456789AB", "sample-0123", "../sample-0123456789ab", "group", ",".join([GROUP] * 65), f"{GROUP}x"],
)
def test_anything_else_is_not_a_sample_group(text):
    with pytest.raises(argparse.ArgumentTypeError):
        start_cli._sample_groups(text)


def test_activities_are_read_case_and_space_insensitively():
    assert start_cli._activities(" CPU, cuda ,,xpu") == ["cpu", "cuda", "xpu"]
    assert start_cli._activities("") == []


@pytest.mark.parametrize("text", ["npu", "cpu,tpu", "cuda;cpu", "CPU,Gpu"])
def test_an_unknown_activity_is_named(text):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        start_cli._activities(text)
    assert "unknown activity" in str(info.value) and "choose from cpu, cuda, xpu" in str(info.value)


# -- the parser ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--pid", "1", "--job", "j"],
        ["--all", "--steps", "2", "--duration", "3"],
        ["--all", "--steps", "0"],
        ["--all", "--steps", "1" + "0" * 20],
        ["--all", "--steps", "2.5"],
        ["--all", "--at-step", "0"],
        ["--all", "--duration", "0"],
        ["--all", "--duration", "inf"],
        ["--all", "--max-duration", "-1"],
        ["--all", "--timeout", "nan"],
        ["--all", "--activities", "gpu"],
        ["--all", "--sample-keep", "0"],
        ["--all", "--sample-keep", "65"],
        ["--all", "--keep-groups", "x"],
    ],
)
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["start", *argv])
    assert info.value.code == 2
    assert "usage: dynprof start" in capsys.readouterr().err


def test_the_request_of_the_defaults():
    assert start_cli.request_from_args(_parse("--pid", "7,8")) == TraceRequest(pids=(7, 8))
    request = start_cli.request_from_args(_parse("--job", "j"))
    assert request.job == "j" and request.pids == () and not request.all
    assert request.steps == 0 and request.duration == 0.0 and request.timeout is None


def test_every_option_reaches_the_request():
    args = _parse(
        "--all",
        "--steps",
        "4",
        "--at-step",
        "90",
        "--record-shapes",
        "--with-stack",
        "--profile-memory",
        "--with-flops",
        "--with-modules",
        "--activities",
        "cuda",
        "--max-duration",
        "120",
        "--no-wait",
        "--timeout",
        "30",
        "--sample-keep",
        "3",
        "--keep-groups",
        GROUP,
    )
    assert start_cli.request_from_args(args) == TraceRequest(
        all=True,
        steps=4,
        at_step=90,
        record_shapes=True,
        with_stack=True,
        profile_memory=True,
        with_flops=True,
        with_modules=True,
        activities=("cuda",),
        max_duration=120.0,
        no_wait=True,
        timeout=30.0,
        sample_keep=3,
        keep_groups=(GROUP,),
    )


def test_a_request_the_kind_refuses_is_a_usage_error_before_anything_starts(capsys, monkeypatch):
    monkeypatch.setattr(_common, "attach_first", lambda args: pytest.fail("nothing is attached"))
    assert main(["start", "--pid", "7", "--attach", "--duration", "2", "--at-step", "5"]) == 2
    assert "--at-step applies to step mode, not to --duration" in capsys.readouterr().err


# -- this node -------------------------------------------------------------------------------------
class FakeCollect:
    def __init__(self, started: Started) -> None:
        self.started = started
        self.calls: list[tuple[TraceRequest, Any]] = []

    def __call__(self, request, progress=None):
        self.calls.append((request, progress))
        return self.started


def _started(results=None, code=0, messages=(), active=None) -> Started:
    return Started(
        exit_code=code,
        messages=list(messages),
        group_id="g1",
        results=results if results is not None else [],
        requested="tracing 2 steps of 1 process(es)",
        active=active,
    )


@pytest.fixture
def collect(monkeypatch):
    def install(started: Started) -> FakeCollect:
        fake = FakeCollect(started)
        monkeypatch.setattr("collectors.torch_trace.collect.collect", fake)
        return fake

    return install


def test_a_start_here_prints_what_was_requested_and_each_result(collect, capsys):
    results = [
        {"pid": 10, "rank": 0, "status": "complete", "artifact": "/store/a", "error": None},
        {"pid": 11, "rank": None, "status": "failed", "artifact": None, "error": f"boom {ESC}"},
    ]
    fake = collect(_started(results, code=8, messages=["rank 1 was slow"]))
    assert main(["start", "--pid", "10,11", "--steps", "2"]) == 8
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "tracing 2 steps of 1 process(es)",
        "rank 0 (pid 10): complete: /store/a",
        "pid 11: failed: boom \\x1b[2J",
    ]
    assert err == "dynprof: rank 1 was slow\n"
    [(request, progress)] = fake.calls
    assert request == TraceRequest(pids=(10, 11), steps=2) and progress.enabled is True


def test_an_open_ended_start_says_how_to_end_it(collect, capsys):
    collect(_started(active="tracing until `dynprof stop --pid 10`"))
    assert main(["start", "--pid", "10"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tracing 2 steps of 1 process(es)",
        "tracing until `dynprof stop --pid 10`",
    ]


def test_json_prints_the_kinds_document_and_shows_no_progress(collect, capsys):
    fake = collect(_started([{"pid": 10, "rank": 0, "status": "complete", "artifact": "/a", "error": None}]))
    assert main(["start", "--job", "j", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {
        "group_id": "g1",
        "results": [{"pid": 10, "rank": 0, "status": "complete", "artifact": "/a", "error": None}],
    }
    assert fake.calls[0][1].enabled is False


def test_collect_local_keeps_what_the_text_needs_out_of_the_document(collect):
    collect(_started(active="until stop"))
    result = start_cli.StartCommand().collect_local(_parse("--all", "--json"))
    assert isinstance(result, Started)
    assert (result.requested, result.active) == ("tracing 2 steps of 1 process(es)", "until stop")
    assert "requested" not in result.to_json() and "active" not in result.to_json()
    collect(_started())
    got = start_cli.StartCommand().collect_local(_parse("--all"))
    assert isinstance(got, Started) and got.active is None


def test_attach_first_then_start(monkeypatch):
    order = []
    monkeypatch.setattr(_common, "attach_first", lambda args: order.append(("attach", args.pid)))
    monkeypatch.setattr("collectors.torch_trace.collect.collect", lambda r, p=None: order.append("start") or _started())
    start_cli.StartCommand().collect_local(_parse("--pid", str(os.getpid()), "--attach", "--steps", "1"))
    assert order == [("attach", [os.getpid()]), "start"]


def test_the_sidecars_start_action_reads_the_kinds_request():
    from dynprof.job import start
    from dynprof.sidecar.table import ACTIONS

    assert ACTIONS["start"].decode == TraceRequest.from_json
    assert ACTIONS["start"].collect is start.collect and ACTIONS["start"].job is start.collect_job


# -- over nodes ------------------------------------------------------------------------------------
A, B = Node("node-a", 8787), Node("node-b", 9000)


class FakeClient:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls: list[tuple[str, dict[str, Any], float | None]] = []

    def action_all(self, nodes, name, options, timeout=None):
        self.calls.append((name, dict(options), timeout))
        return [self.answer(node) for node in nodes]


@pytest.fixture
def client(monkeypatch):
    def install(answer) -> FakeClient:
        fake = FakeClient(answer)
        monkeypatch.setattr(job, "client_for", lambda args: fake)
        return fake

    return install


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--pid", "5", "--steps", "2"], "--pid works on this node only"),
        (["--job", "j", "--duration", "2", "--at-step", "9"], "--at-step applies to step mode, not to --duration"),
    ],
)
def test_over_nodes_the_selection_must_be_job_wide(argv, said, client, capsys):
    fake = client(lambda node: pytest.fail("no node is asked"))
    assert main(["start", *argv, "--hosts", "node-a"]) == 2
    assert said in capsys.readouterr().err
    assert fake.calls == []


def test_collect_nodes_itself_refuses_a_selection_that_is_not_job_wide(client):
    fake = client(lambda node: pytest.fail("no node is asked"))
    args = _parse("--pid", "5", "--steps", "2")
    with pytest.raises(errors.UsageError) as info:
        start_cli.StartCommand().collect_nodes(args, [A])
    assert info.value.message == "with --hosts, select the ranks with --job JOB (or --all)"
    assert fake.calls == []


def _traced(node: Node) -> NodeAnswer:
    rows = [
        {
            "pid": 10 + node.port % 7,
            "rank": 0 if node.host == "node-a" else 1,
            "status": "tracing",
            "artifact": None,
            "error": None,
        }
    ]
    return NodeAnswer(node, True, host=node.host, exit_code=0, result={"group_id": "g", "results": rows, "targets": []})


def test_a_duration_goes_to_every_node_as_it_is(client, capsys):
    fake = client(_traced)
    code = main(["start", "--job", "j", "--duration", "3", "--hosts", "node-a,node-b:9000", "--with-stack"])
    assert code == 0
    [(name, options, timeout)] = fake.calls
    assert name == "start"
    assert options == {"job": "j", "duration": 3.0, "with_stack": True, "timeout": job_start.START_WAIT_DEFAULT_S}
    assert timeout == job_start.START_WAIT_DEFAULT_S + 5.0
    assert capsys.readouterr().out.splitlines() == [
        "rank 0 on node-a: tracing: ",
        "rank 1 on node-b: tracing: ",
    ]


def test_an_open_ended_start_over_nodes_waits_its_timeout(client, capsys):
    fake = client(_traced)
    assert main(["start", "--all", "--timeout", "20", "--hosts", "node-a", "--json"]) == 0
    [(_, options, timeout)] = fake.calls
    assert options == {"all": True, "timeout": 20.0} and timeout == 25.0
    doc = json.loads(capsys.readouterr().out)
    assert [r["node"] for r in doc["results"]] == ["node-a"] and "targets" not in doc["per_node"]["node-a:8787"]


def test_a_node_that_does_not_answer_is_named_and_exit_12(client, capsys):
    client(lambda node: _traced(node) if node.host == "node-a" else NodeAnswer(node, False, error=f"refused {ESC}"))
    assert main(["start", "--job", "j", "--duration", "3", "--hosts", "node-a,node-b:9000"]) == 12
    out, err = capsys.readouterr()
    assert "1 of 2 node(s) did not answer:" in out and "node-b:9000: refused \\x1b[2J" in out
    assert "dynprof: node node-b:9000: refused \\x1b[2J" in err


def test_the_as_is_line_says_what_each_rank_said():
    assert start_cli._as_is_line({"status": "armed", "state": "waiting for step 9"}) == "armed: waiting for step 9"
    assert start_cli._as_is_line({"artifact": "/a", "error": "e"}) == "tracing: /a"
    assert start_cli._as_is_line({"error": "e"}) == "tracing: e"
    assert start_cli._as_is_line({}) == "tracing: "


@pytest.fixture
def steps_plan(monkeypatch, client):
    """A steps start over nodes A and B with the planning replaced: armed at step 50 (one
    message), the ranks' traces as ``followed`` says."""
    fake = client(lambda node: pytest.fail("the plan is replaced"))
    answers = [NodeAnswer(n, True, host=n.host, exit_code=0, result={"group_id": "g", "targets": [1]}) for n in (A, B)]
    seen: dict[str, Any] = {}

    def arm(client, nodes, labels, **kw):
        seen["arm"] = kw
        return job_start.Armed(
            50, 2.0, 0.1, [{"at_step": 50, "lead_s": 2.0, "failed_nodes": []}], answers, [], ["armed"]
        )

    def follow(client, nodes, labels, armed, **kw):
        seen["follow"] = kw
        return seen["followed"]

    monkeypatch.setattr(job_start, "arm_at_one_step", arm)
    monkeypatch.setattr(job_start, "follow_traces", follow)
    seen["client"] = fake
    return seen


def test_a_steps_start_over_nodes_arms_one_step_and_follows_each_trace(steps_plan, capsys):
    steps_plan["followed"] = (
        [
            {"node": "node-a", "rank": 0, "pid": 10, "start_step": 50, "status": "complete", "artifact": "/s/a"},
            {"node": "node-b:9000", "rank": 1, "pid": 11, "start_step": 50, "status": "failed", "error": "x"},
        ],
        [],
    )
    argv = [
        "start",
        "--job",
        "j",
        "--steps",
        "3",
        "--hosts",
        "node-a,node-b:9000",
        "--record-shapes",
        "--timeout",
        "40",
    ]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    arm = steps_plan["arm"]
    assert arm["at_step"] is None and arm["job"] == "j" and arm["select_all"] is False
    assert arm["start_options"] == {
        "job": "j",
        "steps": 3,
        "record_shapes": True,
        "no_wait": True,
        "timeout": job_start.START_ARM_TIMEOUT_S,
    }
    assert arm["ps_options"] == {"job": "j", "timeout": job_start.PS_TIMEOUT_S}
    follow = steps_plan["follow"]
    assert follow["timeout"] == 40.0 and follow["no_wait"] is False
    assert doc["at_step"] == 50 and doc["plan"]["attempts"][0]["at_step"] == 50 and doc["missed"] == []
    assert doc["artifacts"] == [{"node": "node-a", "path": "/s/a"}]
    assert set(doc["per_node"]) == {"node-a:8787", "node-b:9000"} and "targets" not in doc["per_node"]["node-a:8787"]
    # as text: the plan, each rank, and arming's own message on stderr
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "trace of 3 steps on 2 rank(s) of 2 node(s), starting after step 50",
        "rank 0 on node-a: from step 50: complete: /s/a",
        "rank 1 on node-b:9000: from step 50: failed: x",
    ]
    assert "dynprof: armed" in err


def test_a_missed_rank_makes_a_steps_start_fail(steps_plan, capsys):
    steps_plan["followed"] = ([], [{"node": "node-b:9000", "rank": None, "reason": f"went silent {ESC}"}])
    assert main(["start", "--all", "--steps", "3", "--hosts", "node-a,node-b:9000", "--no-wait"]) == 1
    out = capsys.readouterr().out
    assert "MISSED ranks on node-b:9000: went silent \\x1b[2J" in out
    assert steps_plan["follow"]["no_wait"] is True and steps_plan["arm"]["select_all"] is True


def test_the_nodes_text_without_a_common_step():
    doc = {
        "nodes": [{"node": "node-a:8787", "answered": False, "error": "refused"}],
        "at_step": None,
        "results": [],
        "missed": [{"node": "node-a", "rank": 3, "reason": "no answer"}],
        "fetched": [{"id": "x1", "node": "node-a", "error": "gone", "files": 0, "path": None}],
    }
    text = start_cli.StartCommand().render(JobResult(doc, 12, context={"steps": 2}))
    assert text.splitlines() == [
        "trace of 2 steps on 0 rank(s) of 1 node(s), starting after each node's next step boundary",
        "MISSED rank 3 on node-a: no answer",
        "NOT FETCHED x1 from node-a: gone",
        "",
        "1 of 1 node(s) did not answer:",
        "  node-a:8787: refused",
    ]


def test_a_plain_result_renders_as_this_nodes():
    # a node's answer as the sidecar's answer reads back: nothing of the text's, only results
    doc = {"results": [{"pid": 3, "rank": None, "status": "complete", "artifact": "/a", "error": None}]}
    assert start_cli.StartCommand().render(Started.from_json(doc)) == "pid 3: complete: /a"


def test_a_namespace_the_parser_did_not_make_is_checked_by_the_request():
    # the request is checked when made: a negative timeout is the kind's usage error
    with pytest.raises(errors.UsageError):
        start_cli.request_from_args(SimpleNamespace(**{**vars(_parse("--all")), "timeout": -1.0}))
