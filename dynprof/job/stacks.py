"""The nodes' answers to the ``stacks`` action, read back: one decoding for every face that asks
the nodes for their ranks' stacks (``dynprof stacks`` over nodes, the watch's looks), and the
job-wide ``stacks`` answer merged from them (:func:`collect_job`: ``dynprof stacks --hosts`` and
the sidecar's job-wide ``stacks`` action).

Each answer is a stacks document (:func:`collectors.stacks.from_json`, bounded by one
:class:`~collectors.stacks.Budget` for all the answers of one read) or why there is none; each
read is a :class:`~collectors.stacks.Source` named by its node's label, ready for
:func:`collectors.stacks.merge` (``by_host``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collectors.stacks import Budget, Source, Stacks, from_json, merge
from collectors.stacks.collect import StacksRequest
from dynprof import errors
from dynprof.job.answers import node_labels
from dynprof.job.merge import Reach, artifacts_of, envelope, exit_code, maybe_fetch, node_messages, with_fetch
from dynprof.result import Result

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


# -- the job-wide answer ---------------------------------------------------------------------------
def request_of(options: dict[str, Any]) -> StacksRequest:
    """The ``stacks`` action's options as the kind's request (``full`` is the text view's, not
    the request's: an action answers the document, which it does not change)."""
    options = dict(options)
    full = options.pop("full", None)
    if full is not None and not isinstance(full, bool):
        raise errors.UsageError("stacks: option 'full' must be true or false")
    return StacksRequest.from_json(options)


@dataclass
class NodesStacks(Result):
    """The job-wide stacks document (``doc``: the nodes' envelope, the merged stacks, the
    artifacts and what was fetched), and what a text view says besides: the merged ``stacks``,
    how many ``nodes`` were asked and answered, the ``artifacts`` and the ``fetched`` rows."""

    stacks: Stacks = field(default_factory=lambda: Stacks([]))
    nodes: int = 0
    nodes_answered: int = 0
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    fetched: list[dict[str, Any]] | None = None


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> NodesStacks:
    """Every node's sidecar reads its own ranks (``stacks`` there) with ``options`` (the
    action's); their answers are merged as files are, each process named with its node."""
    request = request_of(options)
    answers = reach.client.action_all(nodes, "stacks", options, timeout=request.timeout + 5.0)
    labels = node_labels(nodes)
    sources, failures = read_answers(answers, labels)
    try:
        stacks = merge(sources, by_host=True)
    except errors.ArtifactError as exc:
        raise errors.DynprofError(f"cannot merge: {exc.message}") from None
    stacks.failures = {**failures, **stacks.failures}
    stacks.processes.sort(key=lambda p: (p.job or "", p.rank if p.rank is not None else 1 << 30, p.host or "", p.pid))
    artifacts = artifacts_of(answers, labels, lambda a: [a.result.get("artifact")])
    fetched = maybe_fetch(reach, request.job, answers, artifacts)
    doc = {
        # Each node's processes and groups are in the merged lists (named by node): per_node keeps the rest.
        **envelope(answers, strip=("processes", "groups")),
        **stacks.to_json(),
        "artifacts": artifacts,
        **({"fetched": fetched} if fetched is not None else {}),
    }
    return NodesStacks(
        doc=doc,
        exit_code=with_fetch(exit_code(answers), fetched),
        messages=node_messages(answers),
        stacks=stacks,
        nodes=len(nodes),
        nodes_answered=sum(a.answered for a in answers),
        artifacts=artifacts,
        fetched=fetched,
    )
