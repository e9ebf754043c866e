"""Nodes' answers to a job-wide action, as tests of the job layer and of the job-level
commands write them: two nodes, an answer, a node that did not answer, and a sidecars' client
that hands each node its answer and records what it was asked."""

from __future__ import annotations

from typing import Any

from dynprof.nodes import Node, NodeAnswer

A, B = Node("node-a", 8787), Node("node-b", 9000)


def answered(node: Node, result: Any, code: int = 0, messages: list[str] | None = None) -> NodeAnswer:
    return NodeAnswer(node, True, host=node.host, exit_code=code, result=result, messages=messages or [])


def silent(node: Node, error: str = "connection refused") -> NodeAnswer:
    return NodeAnswer(node, False, error=error)


class FakeClient:
    """The sidecars' client: each node answers what ``answers`` holds for it; ``calls`` keeps
    (node addresses, action, options, timeout) of every call."""

    def __init__(self, answers: dict[Node, NodeAnswer]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str, dict[str, Any], float | None]] = []

    def action_all(self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None):
        self.calls.append(([n.address for n in nodes], name, dict(options), timeout))
        return [self.answers[n] for n in nodes]
