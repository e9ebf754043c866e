"""The nodes' answers to the ``stacks`` action, read back once (dynprof.job.stacks) for
``dynprof stacks`` over nodes and the watch."""

from __future__ import annotations

import pytest

from collectors.stacks import Frame, ProcessStacks, Stacks, ThreadStack
from collectors.stacks.collect import StacksRequest
from dynprof import errors
from dynprof.job.merge import Reach
from dynprof.job.stacks import collect_job, read_answers, request_of
from dynprof.nodes import CommandError, Node, NodeAnswer

A, B, C, D = (Node(h, 8787) for h in ("a", "b", "c", "d"))
LABELS = {A: "a", B: "b", C: "c", D: "d"}


def _doc(*pids: int) -> dict:
    frames = [Frame("step", "/job/train.py", 3)]
    return Stacks(
        [ProcessStacks(pid=p, method="py-spy", threads=[ThreadStack(p, main=True, frames=frames)]) for p in pids]
    ).to_json()


def test_each_answer_is_its_nodes_stacks_or_why_there_are_none():
    answers = [
        NodeAnswer(A, True, exit_code=0, result=_doc(1, 2)),
        NodeAnswer(B, False, error="connection refused"),
        NodeAnswer(C, True, exit_code=1, result="not a document", failure=CommandError("NoAgent", "no agent", "", 1)),
        NodeAnswer(D, True, exit_code=1, result=_doc(), messages=["dynprof: error: ptrace refused"]),
    ]
    sources, failures = read_answers(answers, LABELS)
    # THEN a's processes are read, named by its node; d's empty read is kept beside its failure
    assert [(s.node, [p.pid for p in s.stacks.processes]) for s in sources] == [("a", [1, 2]), ("d", [])]
    assert failures == {
        "node b": "connection refused",
        "node c": "no agent",
        "node d": "dynprof: error: ptrace refused",
    }


def test_an_undecodable_answer_of_a_command_that_succeeded_says_what_is_wrong_with_it():
    _, failures = read_answers([NodeAnswer(A, True, exit_code=0, result={"schema": "other"})], LABELS)
    assert set(failures) == {"node a"} and failures["node a"]


class TwoNodes:
    """The sidecars' client: node a answers its ranks' stacks, node b does not answer."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict, float | None]] = []

    def action_all(self, nodes, name, options, timeout=None):
        self.asked.append((name, dict(options), timeout))
        return [NodeAnswer(A, True, exit_code=0, result=_doc(7)), NodeAnswer(B, False, error="refused")]


def test_the_job_wide_answer_merges_the_nodes_stacks_and_names_the_silent_ones():
    client = TwoNodes()
    got = collect_job({"job": "j", "timeout": 2.0, "full": True}, [A, B], Reach(client))  # type: ignore[arg-type]
    # every node is asked with the same options, the text option too; the wait is its own plus 5 s
    assert client.asked == [("stacks", {"job": "j", "timeout": 2.0, "full": True}, 7.0)]
    assert [p.pid for p in got.stacks.processes] == [7] and got.stacks.failures == {"node b": "refused"}
    assert (got.nodes, got.nodes_answered, got.exit_code) == (2, 1, 12)
    assert got.doc["per_node"]["a:8787"] == {k: v for k, v in _doc(7).items() if k not in ("processes", "groups")}
    assert got.messages == ["node b:8787: refused"] and "fetched" not in got.doc


def test_the_text_option_is_no_part_of_the_request():
    assert request_of({"job": "j", "full": True}) == request_of({"job": "j"}) == StacksRequest(job="j")
    with pytest.raises(errors.UsageError, match="'full' must be true or false"):
        request_of({"job": "j", "full": "yes"})
