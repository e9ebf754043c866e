"""The sidecars' client as a job-wide command sees it, answering from a list given in advance."""

from __future__ import annotations

from typing import Any

from dynprof.nodes import Node, NodeAnswer


def answered(host: str, result: dict[str, Any]) -> NodeAnswer:
    """Node ``host``'s answer (port 8787): it ran the action, which exited 0 with ``result``."""
    return NodeAnswer(Node(host, 8787), True, host=host, exit_code=0, result=result)


class FakeJobClient:
    """``action_all`` of action ``action`` answers ``answers``; the options it was given are kept."""

    def __init__(self, action: str, answers: list[NodeAnswer]) -> None:
        self.action = action
        self.answers = answers
        self.options: dict[str, Any] = {}

    def action_all(
        self, nodes: list[Node], name: str, options: dict[str, Any], timeout: float | None = None
    ) -> list[NodeAnswer]:
        assert name == self.action
        self.options = options
        return self.answers
