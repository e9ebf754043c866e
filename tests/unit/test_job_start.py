"""dynprof.job.start: one trace start step for every rank of every node, and the traces followed
until written. The nodes are simulated in-process and the module's clock is a fake one, so the
plan's lead, the retries, the silent nodes and the wait's end are checked exactly, without
waiting. The `dynprof start --hosts` command over the same functions is in
test_fanout_commands.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.torch_trace.align import ALIGN_LEAD_S, ALIGN_RETRIES, MAX_STEP_NUMBER, alignment_step
from dynprof.job import start as job_start
from dynprof.job.start import (
    NO_RANK_STEPPED,
    PS_TIMEOUT_S,
    START_ARM_TIMEOUT_S,
    START_LEAD_MIN_S,
    START_POLL_S,
    START_SILENCE_MIN_S,
    START_WAIT_DEFAULT_S,
    Armed,
    arm_at_one_step,
    follow_traces,
    steps_of,
)
from dynprof.nodes import CommandError, Node, NodeAnswer

A, B = Node("node-a", 8787), Node("node-b", 8787)
LABELS = {A: "node-a", B: "node-b"}
PS_OPTIONS = {"job": "j", "timeout": PS_TIMEOUT_S}
START_OPTIONS = {"job": "j", "all": False, "steps": 3, "no_wait": True, "timeout": 30.0}


class Clock:
    """The module's ``time``: monotonic time that moves only when asked to (a sleep, or a node's
    round trip)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(job_start, "time", c)
    return c


Handler = Callable[[Node, dict[str, Any]], NodeAnswer]


class Nodes:
    """A client whose every node answers each action through ``handlers[action]``; each action
    takes ``cost[action]`` seconds of the clock. Records every call."""

    max_in_flight = 4

    def __init__(self, clock: Clock, **handlers: Handler) -> None:
        self.clock = clock
        self.handlers = handlers
        self.cost: dict[str, float] = {}
        self.calls: list[tuple[str, list[str], dict[str, Any], float | None]] = []

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        self.calls.append((name, [str(n) for n in nodes], dict(options), timeout))
        self.clock.now += self.cost.get(name, 0.0)
        return [self.handlers[name](n, options) for n in nodes]

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def answer(node: Node, result: Any, code: int = 0, failure: CommandError | None = None, **kw: Any) -> NodeAnswer:
    return NodeAnswer(node, True, host=node.host, exit_code=code, result=result, failure=failure, **kw)


def silent(node: Node, error: str = "timed out after 3 s") -> NodeAnswer:
    return NodeAnswer(node, False, error=error)


class Progress:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.done_calls = 0

    def update(self, text: str) -> None:
        self.lines.append(text)

    def done(self) -> None:
        self.done_calls += 1


def ps_rows(steps: dict[Node, list[tuple[int, int, int]]]) -> Handler:
    """ps answering, per node, (pid, rank, step) trainer rows at 100 ms a step."""

    def ps(node: Node, options: dict[str, Any]) -> NodeAnswer:
        rows = [
            {"pid": pid, "rank": rank, "job": "j", "step": step, "step_time_ms": 100.0, "state": "idle"}
            for pid, rank, step in steps.get(node, [])
        ]
        return answer(node, {"agents": rows})

    return ps


def armed_at(node: Node, options: dict[str, Any]) -> NodeAnswer:
    return answer(node, {"group_id": f"g-{node.host}", "at_step": options.get("at_step"), "targets": []})


def passed(node: Node, options: dict[str, Any]) -> NodeAnswer:
    error = CommandError("AgentError", f"step {options['at_step']} has passed", "", 8)
    return answer(node, {"error": {"message": error.message}}, code=8, failure=error)


def stopped(node: Node, options: dict[str, Any]) -> NodeAnswer:
    return answer(node, {"results": []})


# -- steps_of: every trainer rank that has stepped ----------------------------------------------
def test_steps_of_keeps_the_job_s_trainers_that_have_stepped(clock):
    rows = [
        {"pid": 1, "rank": 0, "job": "j", "step": 40, "step_time_ms": 100.0, "role": "trainer"},
        {"pid": 2, "rank": 1, "job": "j", "step": 41, "step_time_ms": 0},  # no role said: a trainer
        {"pid": 3, "rank": 2, "job": "other", "step": 40},  # another job
        {"pid": 4, "rank": 3, "job": "j", "step": 0},  # not stepped yet
        {"pid": 5, "rank": 4, "job": "j", "step": None},
        {"pid": 6, "rank": 5, "job": "j", "step": True},  # a bool is no step
        {"pid": 7, "rank": 6, "job": "j", "step": "40"},
        {"pid": 8, "rank": 7, "job": "j", "step": -3},
        {"pid": 9, "rank": 8, "job": "j", "step": MAX_STEP_NUMBER},  # past what the wire carries
        {"pid": 10, "rank": 9, "job": "j", "step": 40, "state": "error"},
        {"pid": 11, "rank": 10, "job": "j", "step": 40, "state": "unresponsive"},
        {"pid": 12, "rank": None, "job": "j", "step": 40, "role": "launcher"},
        {"pid": 13, "rank": None, "job": "j", "step": 40, "role": "worker"},
        {"pid": "x", "rank": "y", "job": "j", "step": 42, "step_time_ms": float("nan")},
        "not a row",
    ]
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": rows}) if n == A else silent(n))
    # WHEN the steps are read
    got = steps_of(nodes, [A, B], LABELS, PS_OPTIONS, "j")  # type: ignore[arg-type]
    # THEN every node was asked once with the caller's options, and only the stepping trainers
    # of the job are kept, their step time in seconds (0 where none is a step time)
    assert nodes.calls == [("ps", ["node-a:8787", "node-b:8787"], PS_OPTIONS, PS_TIMEOUT_S + 1.0)]
    assert got == [
        {"node": "node-a", "rank": 0, "pid": 1, "step": 40, "step_time_s": 0.1},
        {"node": "node-a", "rank": 1, "pid": 2, "step": 41, "step_time_s": 0.0},
        {"node": "node-a", "rank": None, "pid": None, "step": 42, "step_time_s": 0.0},
    ]


def test_steps_of_without_a_job_keeps_every_job(clock):
    rows = [{"pid": 1, "rank": 0, "job": "j", "step": 4}, {"pid": 2, "rank": 0, "job": "k", "step": 5}]
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": rows}))
    got = steps_of(nodes, [A], LABELS, {}, None)  # type: ignore[arg-type]
    assert [(r["pid"], r["step"]) for r in got] == [(1, 4), (2, 5)]


@pytest.mark.parametrize("result", [None, [], "x", {"agents": "x"}, {"agents": None}])
def test_steps_of_an_answer_of_the_wrong_shape_is_no_rank(clock, result):
    nodes = Nodes(clock, ps=lambda n, o: answer(n, result))
    assert steps_of(nodes, [A], LABELS, {}, "j") == []  # type: ignore[arg-type]


# -- arm_at_one_step: the plan, and its retries ---------------------------------------------------
def arm(nodes: Nodes, *, at_step: int | None = None, progress: Progress | None = None) -> Armed:
    return arm_at_one_step(
        nodes,  # type: ignore[arg-type]
        [A, B],
        LABELS,
        at_step=at_step,
        job="j",
        select_all=False,
        start_options={**START_OPTIONS, "at_step": 999},
        ps_options=PS_OPTIONS,
        progress=progress or Progress(),
    )


def test_every_node_is_armed_at_one_step_past_the_furthest_rank(clock):
    # GIVEN rank 0 at step 40 on node A, rank 1 at step 41 on node B, 100 ms a step, answering at once
    nodes = Nodes(clock, ps=ps_rows({A: [(10, 0, 40)], B: [(20, 1, 41)]}), start=armed_at)
    progress = Progress()
    # WHEN armed
    armed = arm(nodes, progress=progress)
    # THEN the step is the furthest rank's plus the least lead (1 s: 10 steps, and one more)
    assert START_LEAD_MIN_S == 1.0
    assert armed.at_step == 41 + 11 and armed.lead_s == 1.0 and armed.round_trip_s == 0.0
    # AND every node was armed at it with the caller's options (any step of theirs replaced)
    assert nodes.names() == ["ps", "start"]
    _, where, options, timeout = nodes.calls[1]
    assert where == ["node-a:8787", "node-b:8787"] and timeout == START_ARM_TIMEOUT_S
    assert options == {**START_OPTIONS, "at_step": 52}
    assert armed.attempts == [{"at_step": 52, "lead_s": 1.0, "failed_nodes": []}]
    assert [r["rank"] for r in armed.stepping] == [0, 1] and armed.messages == []
    assert [a.node for a in armed.answers] == [A, B] and all(a.ok for a in armed.answers)
    assert progress.lines == ["arming 2 node(s) at step 52"]
    assert armed.plan() == {"lead_s": 1.0, "round_trip_s": 0.0, "attempts": armed.attempts}


def test_a_slow_round_trip_puts_the_step_further_ahead(clock):
    # GIVEN nodes whose ps takes 0.5 s to come back (the start 0.7 s)
    nodes = Nodes(clock, ps=ps_rows({A: [(10, 0, 40)], B: [(20, 1, 41)]}), start=armed_at)
    nodes.cost = {"ps": 0.5, "start": 0.7}
    # WHEN armed
    armed = arm(nodes)
    # THEN the lead is the single-node lead plus twice the measured ps round trip
    lead = ALIGN_LEAD_S + 2 * 0.5
    assert math.isclose(armed.lead_s, lead) and lead > START_LEAD_MIN_S
    statuses = [SimpleNamespace(step=40, step_time_s=0.1), SimpleNamespace(step=41, step_time_s=0.1)]
    assert armed.at_step == alignment_step(statuses, lead)
    # AND the round trip reported is the longest one seen (the start's)
    assert math.isclose(armed.round_trip_s, 0.7)
    assert armed.plan()["round_trip_s"] == 0.7


def test_a_given_step_is_used_as_is_and_never_retried(clock):
    # GIVEN node B finds the given step already passed
    nodes = Nodes(clock, ps=ps_rows({}), start=lambda n, o: passed(n, o) if n == B else armed_at(n, o))
    # WHEN armed at step 45
    armed = arm(nodes, at_step=45)
    # THEN no ps is asked, every node is armed at 45 once, and nothing is cancelled
    assert nodes.names() == ["start"]
    assert nodes.calls[0][2]["at_step"] == 45
    assert armed.at_step == 45 and armed.stepping == []
    assert armed.attempts == [{"at_step": 45, "lead_s": 1.0, "failed_nodes": ["node-b:8787"]}]


def test_no_rank_stepped_arms_without_a_step_once(clock):
    # GIVEN no rank that has stepped, and a node that fails anyway
    nodes = Nodes(clock, ps=ps_rows({}), start=lambda n, o: silent(n) if n == B else armed_at(n, o))
    progress = Progress()
    # WHEN armed
    armed = arm(nodes, progress=progress)
    # THEN the nodes are armed without a step (each at its own next), once, and the message says why
    assert armed.at_step is None and armed.messages == [NO_RANK_STEPPED]
    assert nodes.names() == ["ps", "start"] and "at_step" not in nodes.calls[1][2]
    assert len(armed.attempts) == 1 and progress.lines == ["arming 2 node(s) at step None"]


def test_a_node_past_the_step_cancels_the_others_and_arms_all_further_ahead(clock):
    # GIVEN node B's rank runs past the first planned step before its arming arrives
    steps = {A: [(10, 0, 40)], B: [(20, 1, 40)]}
    tries = {"n": 0}

    def start(node: Node, options: dict[str, Any]) -> NodeAnswer:
        if node == B and tries["n"] == 0:
            tries["n"] += 1
            steps[B] = [(20, 1, options["at_step"] + 5)]
            return passed(node, options)
        return armed_at(node, options)

    nodes = Nodes(clock, ps=ps_rows(steps), start=start, stop=stopped)
    progress = Progress()
    # WHEN armed
    armed = arm(nodes, progress=progress)
    # THEN the first arming is cancelled on node A only, without waiting, and all are armed again
    first, second = armed.attempts
    assert first == {"at_step": 51, "lead_s": 1.0, "failed_nodes": ["node-b:8787"]}
    assert nodes.names() == ["ps", "start", "ps", "stop", "ps", "start"]
    stop = nodes.calls[3]
    assert stop[1] == ["node-a:8787"] and stop[2] == {"job": "j", "all": False, "no_wait": True}
    # AND the second step is planned from the ranks' new steps with four times the lead
    assert second == {"at_step": 56 + 41, "lead_s": 4.0, "failed_nodes": []}
    assert armed.at_step == second["at_step"] and armed.lead_s == 4.0
    assert "step 51 passed on some node: cancelling and arming further ahead" in progress.lines
    assert all(a.ok for a in armed.answers)


def test_a_node_that_fails_for_another_reason_is_not_retried(clock):
    # GIVEN node B failing its arming while its rank is still short of the step
    nodes = Nodes(
        clock,
        ps=ps_rows({A: [(10, 0, 40)], B: [(20, 1, 40)]}),
        start=lambda n, o: (
            answer(n, {}, code=5, failure=CommandError("NoAgent", "no agent", "", 5)) if n == B else armed_at(n, o)
        ),
        stop=stopped,
    )
    # WHEN armed THEN the steps are read again, but nothing is cancelled or armed again
    armed = arm(nodes)
    assert nodes.names() == ["ps", "start", "ps"]
    assert len(armed.attempts) == 1 and armed.attempts[0]["failed_nodes"] == ["node-b:8787"]


def test_a_node_that_does_not_answer_its_arming_is_not_retried(clock):
    # GIVEN node B silent to its arming, while its rank runs past the step: what its ps says then
    # is not its answer to the arming (nothing says the step passed before the node armed)
    steps = {A: [(10, 0, 40)], B: [(20, 1, 40)]}

    def start(node: Node, options: dict[str, Any]) -> NodeAnswer:
        if node == B:
            steps[B] = [(20, 1, options["at_step"] + 5)]
            return silent(node)
        return armed_at(node, options)

    nodes = Nodes(clock, ps=ps_rows(steps), start=start, stop=stopped)
    # WHEN armed THEN node A's arming is kept, and no node is armed again
    armed = arm(nodes)
    assert "stop" not in nodes.names() and len(armed.attempts) == 1
    assert armed.attempts[0]["failed_nodes"] == ["node-b:8787"]


def test_a_node_that_always_runs_past_the_step_is_tried_at_most_the_retries(clock):
    # GIVEN node B's rank always past whatever step is planned
    steps = {A: [(10, 0, 40)], B: [(20, 1, 40)]}

    def start(node: Node, options: dict[str, Any]) -> NodeAnswer:
        if node == B:
            steps[B] = [(20, 1, options["at_step"] + 1)]
            return passed(node, options)
        return armed_at(node, options)

    nodes = Nodes(clock, ps=ps_rows(steps), start=start, stop=stopped)
    # WHEN armed
    armed = arm(nodes)
    # THEN it is tried ALIGN_RETRIES times, each four times further ahead, cancelled between
    # tries but not after the last (the caller reports node B's miss)
    assert ALIGN_RETRIES == 3
    assert [a["lead_s"] for a in armed.attempts] == [1.0, 4.0, 16.0]
    assert all(a["failed_nodes"] == ["node-b:8787"] for a in armed.attempts)
    assert nodes.names().count("start") == 3 and nodes.names().count("stop") == 2
    assert nodes.names()[-1] == "start"


def test_the_plan_rounds_its_figures():
    armed = Armed(5, 1.23456, 0.0004, [], [], [])
    assert armed.plan() == {"lead_s": 1.235, "round_trip_s": 0.0, "attempts": []}


# -- follow_traces: until each armed rank's trace is written -------------------------------------
def armed_answer(node: Node, group: str, targets: list[dict[str, Any]]) -> NodeAnswer:
    return answer(node, {"group_id": group, "targets": targets})


def target(pid: int, rank: int | None, start_step: int = 50) -> dict[str, Any]:
    return {"pid": pid, "rank": rank, "job": "j", "start_step": start_step}


def written(pid: int, group: str, **trace: Any) -> dict[str, Any]:
    """A ps row of a process whose trace of ``group`` is written."""
    return {
        "pid": pid,
        "state": "idle",
        "last_artifact": f"/store/j/h/rank0/trace/x-{pid}",
        "trace": {"group_id": group, "start_step": 50, "last_artifact_status": "complete", **trace},
    }


def follow(
    nodes: Nodes,
    armed: Armed,
    *,
    no_wait: bool = False,
    timeout: float | None = 60.0,
    node_timeout: float = 3.0,
    progress: Progress | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return follow_traces(
        nodes,  # type: ignore[arg-type]
        [A, B],
        LABELS,
        armed,
        ps_options=PS_OPTIONS,
        no_wait=no_wait,
        timeout=timeout,
        node_timeout=node_timeout,
        progress=progress or Progress(),
    )


def armed_on(*answers: NodeAnswer, at_step: int | None = 50, stepping: list[dict[str, Any]] | None = None) -> Armed:
    return Armed(at_step, 1.0, 0.0, [], list(answers), stepping or [])


def test_each_armed_rank_s_trace_is_followed_until_written(clock):
    # GIVEN two nodes armed at step 50, whose ranks' traces are written by the first poll
    armed = armed_on(armed_answer(A, "ga", [target(10, 1)]), armed_answer(B, "gb", [target(20, 0), target(21, 2)]))
    rows = {A: [written(10, "ga")], B: [written(20, "gb"), written(21, "gb")]}
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": rows[n]}))
    progress = Progress()
    # WHEN followed
    done, missed = follow(nodes, armed, progress=progress)
    # THEN each rank's trace is given, in rank order, with its artifact; none missed
    assert [(r["rank"], r["node"], r["status"], r["start_step"], r["error"]) for r in done] == [
        (0, "node-b", "complete", 50, None),
        (1, "node-a", "complete", 50, None),
        (2, "node-b", "complete", 50, None),
    ]
    assert done[1] == {
        "rank": 1,
        "pid": 10,
        "job": "j",
        "node": "node-a",
        "start_step": 50,
        "status": "complete",
        "artifact": "/store/j/h/rank0/trace/x-10",
        "error": None,
    }
    assert missed == []
    # AND the armed nodes were asked once, with the caller's ps options; the progress ended once
    assert nodes.calls == [("ps", ["node-a:8787", "node-b:8787"], PS_OPTIONS, PS_TIMEOUT_S + 1.0)]
    assert progress.done_calls == 1 and progress.lines == []


def test_a_trace_of_another_group_or_a_busy_process_is_waited_for(clock):
    # GIVEN a rank whose row first shows an older trace, then its trace still being written, then ours
    armed = armed_on(armed_answer(A, "ga", [target(10, 0)]))
    seen = [
        written(10, "an-older-one"),
        {**written(10, "ga"), "state": "tracing"},
        {**written(10, "ga"), "trace": "not an object"},
        written(10, "ga"),
    ]
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": [seen.pop(0)]}))
    progress = Progress()
    t0 = clock.now
    # WHEN followed
    done, missed = follow(nodes, armed, progress=progress)
    # THEN it is polled until its own trace is written, START_POLL_S apart, saying how far it is
    assert [r["status"] for r in done] == ["complete"] and missed == []
    assert nodes.names() == ["ps"] * 4 and seen == []
    assert clock.now - t0 == pytest.approx(3 * START_POLL_S)
    assert progress.lines == ["tracing from step 50: 0/1 rank(s) written"] * 3


def test_what_a_node_says_of_a_written_trace_is_bounded_and_checked(clock):
    # GIVEN ranks whose traces ended partial with a huge error, failed with no status, and
    # written with an artifact that is not a path and no start step of their own
    armed = armed_on(armed_answer(A, "ga", [target(10, 0), target(11, 1, 49), target(12, 2)]))
    rows = [
        written(10, "ga", last_artifact_status="partial", last_error="e" * 5000, start_step=None),
        {**written(11, "ga", last_artifact_status=None, last_error="the job exited"), "last_artifact": 5},
        written(12, "ga", start_step=51),
    ]
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": rows}))
    # WHEN followed
    done, missed = follow(nodes, armed)
    # THEN the error is cut, a missing status is a failure, an artifact that is no text is none
    partial, failed, late = done
    assert partial["status"] == "partial" and partial["error"] == "e" * 2000 and partial["start_step"] == 50
    assert failed["status"] == "failed" and failed["artifact"] is None and failed["start_step"] == 50
    assert late["status"] == "complete" and late["start_step"] == 51
    # AND the failed rank and the one that started at another step are missed, each with why
    assert missed == [
        {"rank": 1, "pid": 11, "node": "node-a", "reason": "the job exited"},
        {"rank": 2, "pid": 12, "node": "node-a", "reason": "armed at step 51, not 50"},
    ]


@pytest.mark.parametrize("status", ["armed", "writing-at-exit", "failed"])
def test_a_trace_that_ended_neither_complete_nor_partial_is_a_miss(clock, status):
    # GIVEN a rank whose trace's last status, once its process is idle, is not a written trace
    armed = armed_on(armed_answer(A, "ga", [target(10, 0)]))
    row = written(10, "ga", last_artifact_status=status, last_error="the job exited")
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": [row]}))
    # WHEN followed (waiting for the traces) THEN it is given as it is, and missed
    done, missed = follow(nodes, armed)
    assert [r["status"] for r in done] == [status]
    assert missed == [{"rank": 0, "pid": 10, "node": "node-a", "reason": "the job exited"}]


def test_a_process_gone_from_its_node_s_list_is_a_failure(clock):
    armed = armed_on(armed_answer(A, "ga", [target(10, 0), target(11, 1)]))
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": [written(10, "ga")]}))
    done, missed = follow(nodes, armed)
    assert [(r["pid"], r["status"]) for r in done] == [(10, "complete"), (11, "failed")]
    reason = "the process left the node's agent list before its trace was written"
    assert done[1]["error"] == reason
    assert missed == [{"rank": 1, "pid": 11, "node": "node-a", "reason": reason}]


@pytest.mark.parametrize(("node_timeout", "limit"), [(3.0, START_SILENCE_MIN_S), (20.0, 60.0)])
def test_a_node_silent_past_the_limit_is_given_up_and_the_others_are_followed(clock, node_timeout, limit):
    # GIVEN node A answering (its rank written at the first poll) and node B silent from the start
    armed = armed_on(armed_answer(A, "ga", [target(10, 0)]), armed_answer(B, "gb", [target(20, 1)]))
    nodes = Nodes(
        clock,
        ps=lambda n, o: silent(n, "timed out after 3 s") if n == B else answer(n, {"agents": [written(10, "ga")]}),
    )
    t0 = clock.now
    # WHEN followed (with a long wait)
    done, missed = follow(nodes, armed, timeout=1000.0, node_timeout=node_timeout)
    # THEN node B's rank is given up once it has been silent past the larger of the floor and
    # three node timeouts, named with the node's own reason
    assert limit == max(START_SILENCE_MIN_S, 3 * node_timeout)
    assert limit < clock.now - t0 <= limit + START_POLL_S
    lost = done[1]
    assert lost["status"] == "failed"
    assert lost["error"] == f"the node stopped answering for {limit:g} s: timed out after 3 s"
    assert missed == [{"rank": 1, "pid": 20, "node": "node-b", "reason": lost["error"]}]
    # AND once node A's trace was written only node B was asked
    assert nodes.calls[0][1] == ["node-a:8787", "node-b:8787"]
    assert all(c[1] == ["node-b:8787"] for c in nodes.calls[1:])


def test_a_node_silent_for_a_while_that_answers_again_is_followed(clock):
    # GIVEN node A silent for 20 s (under the limit), then written
    armed = armed_on(armed_answer(A, "ga", [target(10, 0)]))
    start = clock.now
    nodes = Nodes(
        clock,
        ps=lambda n, o: silent(n) if clock.now - start < 20 else answer(n, {"agents": [written(10, "ga")]}),
    )
    done, missed = follow(nodes, armed)
    assert [r["status"] for r in done] == ["complete"] and missed == []


@pytest.mark.parametrize(("timeout", "wait"), [(5.0, 5.0), (None, START_WAIT_DEFAULT_S)])
def test_a_trace_not_written_in_the_wait_is_a_timeout(clock, timeout, wait):
    # GIVEN a rank that stays armed and never writes its trace
    armed = armed_on(armed_answer(A, "ga", [target(10, 0)]))
    nodes = Nodes(clock, ps=lambda n, o: answer(n, {"agents": [{"pid": 10, "state": "tracing", "trace": {}}]}))
    t0 = clock.now
    # WHEN followed
    done, missed = follow(nodes, armed, timeout=timeout)
    # THEN it is a timeout once the wait (the given one, else the default) has passed
    assert wait < clock.now - t0 <= wait + START_POLL_S
    assert [(r["status"], r["error"]) for r in done] == [("timeout", f"not written within {wait:g} s")]
    assert missed == [{"rank": 0, "pid": 10, "node": "node-a", "reason": f"not written within {wait:g} s"}]


def test_no_wait_returns_the_armed_ranks_without_polling(clock):
    armed = armed_on(armed_answer(A, "ga", [target(10, 1)]), armed_answer(B, "gb", [target(20, 0, 49)]))
    nodes = Nodes(clock)  # any action asked would fail: no handler
    progress = Progress()
    done, missed = follow(nodes, armed, no_wait=True, progress=progress)
    assert nodes.calls == [] and progress.done_calls == 1
    assert [(r["rank"], r["status"], r["start_step"]) for r in done] == [(0, "armed", 49), (1, "armed", 50)]
    # an armed rank is no miss, but one armed at another step than the plan's is
    assert missed == [{"rank": 0, "pid": 20, "node": "node-b", "reason": "armed at step 49, not 50"}]


def test_without_a_common_step_a_rank_s_own_start_step_is_no_miss(clock):
    armed = armed_on(armed_answer(A, "ga", [target(10, 0, 7)]), at_step=None)
    nodes = Nodes(clock)
    done, missed = follow(nodes, armed, no_wait=True)
    assert [r["start_step"] for r in done] == [7] and missed == []


def test_nodes_that_were_not_armed_are_missed_with_their_reason(clock):
    # GIVEN node A that did not answer its arming, node B whose command failed, for ranks seen
    # stepping on node B only
    stepping = [
        {"node": "node-b", "rank": 3, "pid": 30, "step": 40, "step_time_s": 0.1},
        {"node": "node-b", "rank": 1, "pid": 31, "step": 40, "step_time_s": 0.1},
    ]
    failure = CommandError("AgentError", "step 50 has passed", "", 8)
    armed = armed_on(silent(A, "connection refused"), answer(B, {}, code=8, failure=failure), stepping=stepping)
    nodes = Nodes(clock)
    # WHEN followed
    done, missed = follow(nodes, armed)
    # THEN nothing is polled; node B's ranks are each missed with its error, node A as a node
    assert done == [] and nodes.calls == []
    assert missed == [
        {"rank": 1, "pid": 31, "node": "node-b", "reason": "step 50 has passed"},
        {"rank": 3, "pid": 30, "node": "node-b", "reason": "step 50 has passed"},
        {"rank": None, "pid": None, "node": "node-a", "reason": "connection refused"},
    ]


def test_a_failed_arming_without_an_error_of_its_own_says_no_trace_started(clock):
    armed = armed_on(answer(A, {}, code=1), answer(B, {}, code=2, messages=["dynprof: error: no agent of job 'j'"]))
    done, missed = follow(Nodes(clock), armed)
    assert done == []
    assert missed == [
        {"rank": None, "pid": None, "node": "node-a", "reason": "no trace started"},
        {"rank": None, "pid": None, "node": "node-b", "reason": "dynprof: error: no agent of job 'j'"},
    ]


@pytest.mark.parametrize(
    "result",
    [None, "text", {"group_id": "g", "targets": "x"}, {"group_id": "g", "targets": [{"pid": None}, {"pid": "7"}, 5]}],
    ids=["none", "text", "targets-text", "targets-without-pid"],
)
def test_an_arming_answer_of_the_wrong_shape_follows_nothing(clock, result):
    armed = armed_on(answer(A, result))
    nodes = Nodes(clock)
    done, missed = follow(nodes, armed)
    assert done == [] and missed == [] and nodes.calls == []
