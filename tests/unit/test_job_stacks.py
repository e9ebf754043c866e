"""The nodes' answers to the ``stacks`` action, read back once (dynprof.job.stacks) for
``dynprof stacks`` over nodes and the watch."""

from __future__ import annotations

from collectors.stacks import Frame, ProcessStacks, Stacks, ThreadStack
from dynprof.job.stacks import read_answers
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
