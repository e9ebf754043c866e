"""dynprof.job.healthcheck: the job-wide healthcheck through the sidecars (each asked the
request's action options, the answers judged together), its srun launcher (the request handed
to each task as one JSON argument; srun's labelled output read back per task, bounded) and
each node's wait."""

from __future__ import annotations

import json

from dynprof.job.healthcheck import (
    MAX_NODE_WAIT_S,
    MAX_TASK_OUTPUT_BYTES,
    MAX_TASK_OUTPUT_LINES,
    MAX_UNLABELLED_LINES,
    SIDECAR_GRACE_S,
    JobWide,
    TaskOutput,
    collect_nodes,
    node_wait,
    srun_command,
)
from dynprof.nodes import Node, NodeAnswer
from healthcheck.collect import HealthcheckRequest


def test_srun_runs_one_healthcheck_per_node_with_the_request_as_one_argument():
    request = HealthcheckRequest(level="standard", skip=("disk_free", "ib_ports"), smi_tool="ppu-smi")
    argv = srun_command(request, JobWide(srun_args=("--overlap",), srun_python="/opt/py"), 4)
    assert argv[:6] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--label", "--kill-on-bad-exit=0"]
    assert argv[6:11] == ["--overlap", "/opt/py", "-m", "healthcheck.collect", "--task"]
    assert len(argv) == 12
    assert HealthcheckRequest.from_json(json.loads(argv[11]), local=True) == request


def test_each_nodes_wait_is_the_timeout_given_else_by_level_and_scale():
    assert node_wait(HealthcheckRequest(level="quick"), None) == 120.0
    assert node_wait(HealthcheckRequest(level="standard", timeout_scale=2.0), None) == MAX_NODE_WAIT_S
    assert node_wait(HealthcheckRequest(level="standard", timeout_scale=2.0), None, cap=None) == 1200.0
    assert node_wait(HealthcheckRequest(level="full"), 30.0) == 30.0


def test_labelled_output_is_split_per_task_and_bounded():
    # GIVEN the interleaved lines of three tasks (srun pads labels when there are ten or more)
    out = TaskOutput(3)
    for line in ['0: {"a":', " 1: nonsense", "0:  1}", "9: out of range", "no label", "2: " + "x" * 100]:
        out.add(line + "\n")
    out.add("2: " + "y" * MAX_TASK_OUTPUT_BYTES + "\n")

    # THEN each task has its own text; a task over its bound is refused as a whole
    assert out.lines[0] == ['{"a":', " 1}"] and out.lines[1] == ["nonsense"]
    assert 2 in out.over and 2 not in out.lines
    assert out.unlabelled == 2
    assert out.outcome(0, "n0", False).report == {"a": 1}
    assert not out.outcome(1, "n1", False).answered
    assert "over 4 MiB" in (out.outcome(2, "n2", False).error or "")


def test_a_task_of_short_lines_is_refused_by_its_line_bound_long_before_its_bytes():
    # GIVEN two tasks: one prints a report, the other short lines on and on
    out = TaskOutput(2)
    out.add_lines([b"0: {", b'0:   "a": 1', b"0: }"])
    out.add_lines([b"1: x"] * (MAX_TASK_OUTPUT_LINES + 1))
    # THEN the chatty one is over its bound (a few hundred kB, far under 4 MiB), nothing of it
    # kept, and every task is decided, so srun can be stopped
    assert 1 in out.over and 1 not in out.lines and out.sizes[1] < MAX_TASK_OUTPUT_BYTES
    assert out.decided() and out.flooded()
    assert out.outcome(0, "n0", False).report == {"a": 1}
    assert out.outcome(1, "n1", False).error == f"its task printed over {MAX_TASK_OUTPUT_LINES} lines: refused"


def test_lines_that_name_no_task_are_bounded_and_the_unanswered_tasks_named():
    # GIVEN a task that answered, one half way through its report, and srun printing lines
    # that name no task of the allocation
    out = TaskOutput(3)
    out.add_lines([b"0: {", b'0:   "a": 1', b"0: }", b"1: {", b'1:   "b":'])
    out.add_lines([b"no label"] * MAX_UNLABELLED_LINES)
    assert not out.noisy()
    # WHEN one more comes
    out.add_lines([b"7: another allocation's task"])
    # THEN srun is to be stopped, and the tasks that had not answered say that it was
    assert out.noisy()
    assert out.outcome(0, "n0", False, stopped=True).report == {"a": 1}
    assert out.outcome(1, "n1", False, stopped=True).error == "srun was stopped before its task answered"
    assert out.outcome(2, "n2", False, stopped=True).error == "srun was stopped before its task answered"


class FakeClient:
    """The sidecars' client: each node answers the report it is given, or nothing."""

    max_in_flight = 8

    def __init__(self, answers: dict[str, NodeAnswer]) -> None:
        self.answers = answers
        self.timeout = 0.0
        self.asked: list[tuple[str, str, dict, float | None]] = []

    def action(self, node: Node, name: str, options: dict, timeout: float | None = None) -> NodeAnswer:
        self.asked.append((node.address, name, options, timeout))
        return self.answers[node.address]


class Quiet:
    def update(self, text: str) -> None:
        pass

    def done(self) -> None:
        pass


def node_report(exit_code: int = 0) -> dict:
    return {
        "schema": "dynprof.healthcheck",
        "schema_version": 1,
        "level": "quick",
        "exit_code": exit_code,
        "devices": [],
        "checks": [{"name": "disk_free", "status": "pass" if exit_code == 0 else "fail", "value": 1.0}],
    }


def test_every_sidecar_is_asked_the_requests_action_options_and_the_answers_judged_together():
    # GIVEN two nodes on one host (named host:port), one that answers healthy, one whose check
    # failed, and a third that does not answer (refused its token)
    nodes = [Node("a", 1), Node("a", 2), Node("b", 1)]
    client = FakeClient(
        {
            "a:1": NodeAnswer(nodes[0], True, exit_code=0, result=node_report()),
            "a:2": NodeAnswer(nodes[1], True, exit_code=2, result=node_report(2)),
            "b:1": NodeAnswer(nodes[2], False, error="401 Unauthorized", status=401),
        }
    )
    request = HealthcheckRequest(fail_below=0.8, skip=("ecc_errors",))
    # WHEN the job-wide healthcheck runs through the sidecars
    report = collect_nodes(request, JobWide(peer_threshold=0.2), nodes, client, 30.0, Quiet())  # type: ignore[arg-type]
    # THEN each was asked the request's action options, under the level's wait, the client's
    # timeout the nodes' own plus the sidecars' grace
    assert {a[0] for a in client.asked} == {"a:1", "a:2", "b:1"}
    assert all(a[1:] == ("healthcheck", request.action_options(), 120.0) for a in client.asked)
    assert client.timeout == 30.0 + SIDECAR_GRACE_S
    # AND the answers are judged together, each node named as output names it
    by_label = {v.outcome.label: v for v in report.verdicts}
    assert {label: v.status for label, v in by_label.items()} == {"a:1": "healthy", "a:2": "unhealthy", "b": "unknown"}
    assert by_label["b"].reasons[0].code == "refused"
    assert (report.threshold, report.how, report.exit_code) == (0.2, "sidecars", 2)
