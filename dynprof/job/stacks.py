"""The nodes' answers to the ``stacks`` action, read back: one decoding for every face that asks
the nodes for their ranks' stacks (``dynprof stacks`` over nodes, the watch's looks).

Each answer is a stacks document (:func:`collectors.stacks.from_json`, bounded by one
:class:`~collectors.stacks.Budget` for all the answers of one read) or why there is none; each
read is a :class:`~collectors.stacks.Source` named by its node's label, ready for
:func:`collectors.stacks.merge` (``by_host``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from collectors.stacks import Budget, Source, from_json
from dynprof import errors

if TYPE_CHECKING:  # the HTTP client is imported only where nodes are asked
    from dynprof.nodes import Node, NodeAnswer


def read_answer(answer: NodeAnswer, label: str, budget: Budget) -> tuple[Source | None, str | None]:
    """One node's answer: its stacks as a :class:`Source` named ``label`` (None: none could be
    read), and why the node's read failed (None: it did not). A command that failed but still
    sent the processes it read gives both."""
    if not answer.answered:
        return None, answer.error or "no answer"
    try:
        found = from_json(answer.result, budget)
    except errors.ArtifactError as exc:
        why = (answer.command_error() or f"exit code {answer.exit_code}") if answer.exit_code else exc.message
        return None, why
    failure = None
    if answer.exit_code and not found.processes:
        failure = answer.command_error() or f"exit code {answer.exit_code}"
    return Source(found, node=label), failure


def read_answers(
    answers: Sequence[NodeAnswer], labels: Mapping[Node, str], budget: Budget | None = None
) -> tuple[list[Source], dict[str, str]]:
    """Every node's answer (:func:`read_answer`): the stacks read, in the answers' order, and
    each failure by ``"node LABEL"``."""
    shared = budget if budget is not None else Budget()
    sources: list[Source] = []
    failures: dict[str, str] = {}
    for answer in answers:
        label = labels[answer.node]
        source, failure = read_answer(answer, label, shared)
        if failure is not None:
            failures[f"node {label}"] = failure
        if source is not None:
            sources.append(source)
    return sources, failures
