"""Commands over many nodes against simulated nodes: start planning (one step for all, retry when it
passed, misses named), one level only, and garbage answers of every shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynprof.cli import _node_args, job, main
from dynprof.nodes import CommandError, Node, NodeAnswer


class FakeNodes:
    """Nodes whose ranks step on their own; ``start`` arms them, a later ps shows them written."""

    def __init__(self, ranks: dict[Node, list[dict[str, Any]]], passed_once: set[Node] = frozenset()) -> None:
        self.ranks = ranks
        self.passed_once = set(passed_once)
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.armed: dict[Node, tuple[int, str]] = {}
        self.polls = 0

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        out = []
        for node in nodes:
            self.calls.append((str(node), name, dict(options)))
            out.append(getattr(self, "_" + name)(node, options))
        return out

    def _answer(self, node: Node, result: Any, code: int = 0, failure: CommandError | None = None) -> NodeAnswer:
        return NodeAnswer(node, True, host=node.host, exit_code=code, result=result, failure=failure)

    def _ps(self, node: Node, options: dict[str, Any]) -> NodeAnswer:
        self.polls += 1
        rows = []
        for r in self.ranks[node]:
            row = {"pid": r["pid"], "rank": r["rank"], "job": "j", "step": r["step"], "step_time_ms": 100.0}
            at = self.armed.get(node)
            if at is not None:
                r["step"] = max(r["step"], at[0] + 3)  # the trace ran and was written
                row.update(
                    state="idle",
                    last_artifact=f"/store/j/{node.host}/rank{r['rank']}/trace/x-{r['pid']}",
                    trace={"group_id": at[1], "start_step": at[0], "last_artifact_status": "complete"},
                )
            else:
                row.update(state="idle", trace={})
            rows.append(row)
        return self._answer(node, {"agents": rows})

    def _start(self, node: Node, options: dict[str, Any]) -> NodeAnswer:
        assert options["no_wait"] is True and "hosts" not in options
        at = options["at_step"]
        if node in self.passed_once:
            self.passed_once.discard(node)
            for r in self.ranks[node]:
                r["step"] = at + 5  # this node ran ahead of the plan
            error = CommandError("AgentError", f"step {at} has passed", "", 8)
            return self._answer(node, {"error": {"message": error.message}}, code=8, failure=error)
        group = f"g-{node.port}-{at}"
        self.armed[node] = (at, group)
        targets = [{"pid": r["pid"], "rank": r["rank"], "job": "j", "start_step": at} for r in self.ranks[node]]
        return self._answer(node, {"group_id": group, "at_step": at, "state": "armed", "targets": targets})

    def _stop(self, node: Node, options: dict[str, Any]) -> NodeAnswer:
        self.armed.pop(node, None)
        return self._answer(node, {"results": []})


A, B = Node("node-a", 8787), Node("node-b", 8787)


@pytest.fixture
def fake(monkeypatch):
    def install(nodes: FakeNodes) -> FakeNodes:
        monkeypatch.setattr(job, "client_for", lambda args: nodes)
        monkeypatch.setattr("dynprof.job.start.START_POLL_S", 0.0)
        return nodes

    return install


def test_one_step_for_every_rank_of_every_node(fake, capsys):
    # GIVEN rank 0 on node A at step 40 and rank 1 on node B at step 41, 100 ms a step
    nodes = fake(FakeNodes({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 41}]}))
    # WHEN a 3-step trace is started over both
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--json"])
    # THEN both are armed at the same step, past the furthest rank by at least the lead
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    at = doc["at_step"]
    assert at >= 41 + 10  # 1 s of lead at 100 ms a step
    starts = [c for c in nodes.calls if c[1] == "start"]
    assert [c[2]["at_step"] for c in starts] == [at, at]
    assert [(r["rank"], r["node"], r["start_step"], r["status"]) for r in doc["results"]] == [
        (0, "node-a", at, "complete"),
        (1, "node-b", at, "complete"),
    ]
    assert doc["missed"] == [] and len(doc["artifacts"]) == 2


def test_a_node_past_the_step_makes_every_node_arm_again_further_ahead(fake, capsys):
    # GIVEN node B's rank runs past the first chosen step before its request arrives
    nodes = fake(FakeNodes({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 40}]}, {B}))
    # WHEN the trace is started
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--json"])
    # THEN node A's first arming is cancelled and both are armed at one later step
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    first, second = doc["plan"]["attempts"]
    assert first["failed_nodes"] == ["node-b:8787"] and second["failed_nodes"] == []
    assert second["at_step"] > first["at_step"] + 5 and second["lead_s"] == 4 * first["lead_s"]
    assert ("node-a:8787", "stop") in [(c[0], c[1]) for c in nodes.calls]
    assert {r["start_step"] for r in doc["results"]} == {doc["at_step"]} == {second["at_step"]}


def test_a_node_that_does_not_answer_is_a_miss_and_exit_12(fake, capsys):
    # GIVEN node B down
    class Down(FakeNodes):
        def action_all(self, nodes, name, options, timeout=None):
            live = super().action_all([n for n in nodes if n != B], name, options, timeout)
            by = {a.node: a for a in live}
            return [
                by.get(n) or NodeAnswer(n, False, error=f"connection refused: is `dynprof serve` running on {n}?")
                for n in nodes
            ]

    fake(Down({A: [{"pid": 10, "rank": 0, "step": 40}], B: []}))
    # WHEN the trace is started over both
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--json"])
    # THEN node A's rank is traced, node B is named with its reason, and the exit code says a node failed
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 12
    assert [(r["rank"], r["status"]) for r in doc["results"]] == [(0, "complete")]
    assert doc["missed"] == [{"rank": None, "pid": None, "node": "node-b", "reason": doc["nodes"][1]["error"]}]
    assert "connection refused" in doc["nodes"][1]["error"] and "node node-b:8787: connection refused" in captured.err


GARBAGE: list[Any] = [
    None,
    [],
    "text",
    7,
    {"agents": "x", "results": 5, "artifacts": {"a": 1}, "processes": None, "dumps": [], "targets": "t"},
    {
        "agents": [1, None, {"pid": "x", "rank": "y", "cmdline": 5, "age_s": "old", "step": [], "trace": "t"}],
        "processes": [
            {"pid": 3, "rank": True, "main_thread": {"frames": [{"line": "abc", "native": True, "library": 9}, 4]}},
            {"pid": 4, "main_thread": {"frames": "no"}},
            {"pid": None},
        ],
        "failures": {"x": ["y"]},
        "dumps": {"0": {"dumps": {"nccl": {"entries": "bad", "pg_status": 3}}}, "x": 1, "1": "doc"},
        "notes": "n",
        "results": [{"rank": "0", "pid": {}, "artifact": 5, "status": None}, "row"],
        "artifacts": [{"id": "../../etc", "created_at": 3, "bytes": "big"}, {"id": None}],
        "group_id": ["g"],
        "targets": [{"pid": 1, "rank": 0, "start_step": "s"}, {"pid": None}],
    },
]


class GarbageNodes:
    max_in_flight = 4

    def __init__(self, result: Any) -> None:
        self.result = result

    def action_all(self, nodes, name, options, timeout=None):
        return [NodeAnswer(n, True, host="h", exit_code=0, result=self.result) for n in nodes]

    def artifact(self, node, artifact_id):  # fetch: never reached with garbage ids
        from dynprof.job.client import NodeFailure

        raise NodeFailure("no")


@pytest.mark.parametrize("result", GARBAGE, ids=range(len(GARBAGE)))
@pytest.mark.parametrize(
    "argv",
    [
        ["ps"],
        ["stacks", "--job", "j"],
        ["nccl", "--job", "j"],
        ["stop", "--job", "j"],
        ["memory", "--job", "j"],
        ["ls"],
        ["start", "--job", "j", "--steps", "2", "--timeout", "0.2"],
        ["start", "--job", "j", "--duration", "1"],
    ],
    ids=lambda a: a[0] + ("-" + a[-1] if a[0] == "start" else ""),
)
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_garbage_from_the_nodes_never_crashes_a_command(monkeypatch, capsys, tmp_path, result, argv, as_json):
    # GIVEN nodes whose sidecars answer with garbage of every shape
    monkeypatch.setattr(job, "client_for", lambda args: GarbageNodes(result))
    monkeypatch.setattr("dynprof.job.start.START_POLL_S", 0.0)
    extra = ["--fetch", str(tmp_path / "f")] if argv[0] in ("ls", "stacks", "nccl", "memory", "start") else []
    # WHEN a command merges them
    code = main([*argv, "--hosts", "a,b", *(["--json"] if as_json else []), *extra])
    # THEN it ends with an exit code, prints what it could, and nothing was written outside DIR
    out = capsys.readouterr().out
    assert isinstance(code, int)
    if as_json:
        json.loads(out)
    assert not (tmp_path.parent / "etc").exists()


def test_a_sidecar_action_never_fans_out_again():
    # GIVEN a job-level command whose job-wide answer must never be reached from a node

    import dataclasses

    from dynprof.result import Result
    from dynprof.sidecar.actions import run_action
    from dynprof.sidecar.table import ACTIONS

    def collect_nodes(options, hosts, cacert):
        raise AssertionError("a sidecar's action fanned out")

    row = ACTIONS["ps"]
    table = {
        "ps": dataclasses.replace(row, decode=lambda o: o, collect=lambda r: Result({"agents": []}), job=collect_nodes)
    }
    # WHEN the sidecar runs ps as an action (as the fan-out asks a node: without hosts)
    answer = run_action("ps", {}, table=table)
    # THEN it answers with this node's agents only: the node-side call is its request's collect
    assert answer["exit_code"] == 0 and answer["result"] == {"agents": []}


def test_one_node_selectors_stay_local_unless_nodes_are_named(monkeypatch):
    from argparse import Namespace

    from dynprof import errors

    monkeypatch.setattr(_node_args, "resolve_nodes", lambda args: [A])
    # --pid, --attach, --core with discovered nodes: this node
    for extra in ({"pid": [1]}, {"attach": True}, {"core": "core.1"}):
        assert _node_args.nodes_requested(Namespace(hosts=None, hostfile=None, **extra)) is None
    # named nodes with them: a usage error
    with pytest.raises(errors.UsageError, match="--pid works on this node only"):
        _node_args.nodes_requested(Namespace(hosts="node-a", hostfile=None, pid=[1]))
    # otherwise the nodes found
    assert _node_args.nodes_requested(Namespace(hosts=None, hostfile=None, job="j")) == [A]


def test_no_wait_returns_once_every_node_is_armed(fake, capsys):
    nodes = fake(FakeNodes({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 40}]}))
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--no-wait", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["missed"] == []
    assert [(r["rank"], r["status"], r["start_step"]) for r in doc["results"]] == [
        (0, "armed", doc["at_step"]),
        (1, "armed", doc["at_step"]),
    ]
    assert [c[1] for c in nodes.calls] == ["ps", "ps", "start", "start"]  # no polling


def test_a_given_step_that_one_node_passed_is_not_retried_and_its_rank_is_named(fake, capsys):
    nodes = fake(FakeNodes({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 40}]}, {B}))
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--at-step", "45", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 8  # node B's own exit code
    assert doc["at_step"] == 45 and len(doc["plan"]["attempts"]) == 1
    assert [(r["rank"], r["status"]) for r in doc["results"]] == [(0, "complete")]
    assert doc["missed"] == [{"rank": None, "pid": None, "node": "node-b", "reason": "step 45 has passed"}]
    assert "stop" not in [c[1] for c in nodes.calls]


def test_a_node_that_goes_silent_while_tracing_is_given_up(fake, capsys, monkeypatch):
    # GIVEN node B answers the arming, then never again
    class Silent(FakeNodes):
        def action_all(self, nodes, name, options, timeout=None):
            out = super().action_all(nodes, name, options, timeout)
            if name == "ps" and B in self.armed:
                silent = NodeAnswer(B, False, error="timed out after 3 s waiting for node-b:8787")
                return [silent if a.node == B else a for a in out]
            return out

    monkeypatch.setattr("dynprof.job.start.START_SILENCE_MIN_S", 0.0)
    fake(Silent({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 40}]}))
    # WHEN the trace is followed, with a short node timeout
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--json", "--node-timeout", "0.01",
                 "--timeout", "5"])  # fmt: skip
    # THEN node B's rank is reported as lost with the node's reason, without waiting for the timeout
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    lost = [m for m in doc["missed"] if m["node"] == "node-b"]
    assert lost and "stopped answering" in lost[0]["reason"] and "timed out" in lost[0]["reason"]
    assert [(r["rank"], r["status"]) for r in doc["results"]] == [(0, "complete"), (1, "failed")]


def test_each_node_s_own_messages_reach_stderr_with_its_name(monkeypatch, capsys):
    # GIVEN a node whose command failed with an error and its advice, and a node that warned
    class Talking:
        def action_all(self, nodes, name, options, timeout=None):
            return [
                NodeAnswer(
                    A,
                    True,
                    exit_code=5,
                    result={"error": {"message": "no agent of job 'j' on this node"}},
                    messages=["dynprof: error: no agent of job 'j' on this node", "  what to do: attach one"],
                    failure=CommandError("NoAgent", "no agent of job 'j' on this node", "attach one", 5),
                ),
                NodeAnswer(B, True, exit_code=0, result={"agents": []}, messages=["dynprof: skipping 1 process"]),
            ]

    monkeypatch.setattr(job, "client_for", lambda args: Talking())
    # WHEN ps fans out
    code = main(["ps", "--job", "j", "--hosts", "node-a,node-b", "--json"])
    # THEN stderr carries each node's lines under its name, and the summary keeps them
    captured = capsys.readouterr()
    assert code == 5
    assert "dynprof: node node-a:8787: error: no agent of job 'j' on this node" in captured.err
    assert "dynprof: node node-a:8787:   what to do: attach one" in captured.err
    assert "dynprof: node node-b:8787: skipping 1 process" in captured.err
    doc = json.loads(captured.out)
    assert doc["nodes"][0]["error"] == "no agent of job 'j' on this node"
    assert doc["nodes"][1]["messages"] == ["dynprof: skipping 1 process"]


def test_commands_on_this_node_import_no_http_client_and_defaults_agree():
    import subprocess
    import sys

    from dynprof.job import client as fanout

    assert _node_args.DEFAULT_NODE_TIMEOUT_S == fanout.DEFAULT_NODE_TIMEOUT_S
    assert _node_args.DEFAULT_MAX_IN_FLIGHT == fanout.DEFAULT_MAX_IN_FLIGHT
    code = (
        "import sys; from dynprof.cli import build_parser; build_parser('ps');"
        "print(sorted(m for m in ('http.client', 'ssl', 'dynprof.job.client', 'dynprof.sidecar.actions') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


CRAFTED_STEP_TIMES: list[Any] = [1e-320, 5e-324, 0, 0.0, -100.0, float("nan"), float("inf"), -float("inf"), 1e308,
                                 10**400, True, "100", None]  # fmt: skip


@pytest.mark.parametrize("step_time_ms", CRAFTED_STEP_TIMES, ids=lambda v: repr(v)[:12])
def test_a_crafted_step_time_from_a_node_gives_a_clean_start_step(fake, capsys, step_time_ms):
    # GIVEN node B reports a step time that is no measurement (a denormal, 0, negative, NaN,
    # infinite, huge, not a number), node A a real one
    class Crafted(FakeNodes):
        def _ps(self, node, options):
            answer = super()._ps(node, options)
            if node == B:
                for row in answer.result["agents"]:
                    row["step_time_ms"] = step_time_ms
            return answer

    fake(Crafted({A: [{"pid": 10, "rank": 0, "step": 40}], B: [{"pid": 20, "rank": 1, "step": 41}]}))
    # WHEN a 3-step trace is started over both
    code = main(["start", "--job", "j", "--hosts", "node-a,node-b", "--steps", "3", "--json"])
    # THEN both ranks are traced from one step, planned from node A's pace (1 s at 100 ms a step)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["at_step"] == 41 + 11
    assert [(r["rank"], r["start_step"], r["status"]) for r in doc["results"]] == [
        (0, doc["at_step"], "complete"),
        (1, doc["at_step"], "complete"),
    ]


@pytest.mark.parametrize("step_time_ms", CRAFTED_STEP_TIMES, ids=lambda v: repr(v)[:12])
def test_a_crafted_step_time_alone_puts_the_start_two_steps_ahead(fake, capsys, step_time_ms):
    # GIVEN the only rank reports a step time that is no measurement
    class Crafted(FakeNodes):
        def _ps(self, node, options):
            answer = super()._ps(node, options)
            for row in answer.result["agents"]:
                row["step_time_ms"] = step_time_ms
            return answer

    fake(Crafted({A: [{"pid": 10, "rank": 0, "step": 40}]}))
    # WHEN a trace is started
    code = main(["start", "--job", "j", "--hosts", "node-a", "--steps", "3", "--json"])
    # THEN the pace counts as unknown: the start is two steps past the rank's, as for a missing one
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["at_step"] == 42
