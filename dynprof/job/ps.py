"""``ps``: the dynprof agents of this node (:func:`collect`, an :class:`Agents` answer), or of a
whole job's nodes, merged in rank order (:func:`collect_job`, each node's answer read with
:meth:`Agents.from_json`). ``dynprof ps`` and the sidecar's ``ps`` action answer with these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynprof import errors
from dynprof.agents import agent_rows
from dynprof.job.answers import answer_rows, node_labels, rank_key, read
from dynprof.job.merge import JobResult, Reach, envelope, exit_code, node_messages
from dynprof.node_requests import PsRequest
from dynprof.nodes import Node
from dynprof.output import printable
from dynprof.registry import list_records
from dynprof.result import Result


@dataclass
class Agents(Result):
    """One node's ``ps`` answer: a row per agent (``agents``: :func:`dynprof.agents.agent_rows`),
    and, for its text only, the job it was asked about (``job``)."""

    agents: list[dict[str, Any]] = field(default_factory=list)
    job: str | None = None

    def to_json(self) -> dict[str, Any]:
        """``dynprof ps --json`` on one node, the sidecar's ``ps`` answer: ``{"agents": [...]}``."""
        return {"agents": self.agents}

    @classmethod
    def from_json(cls, doc: Any) -> Agents:
        """A node's answer, untrusted: an object with a list ``agents`` (its rows that are objects
        kept, as they are); else :class:`~dynprof.errors.ArtifactError`."""
        return cls(agents=answer_rows(doc, "agents", "ps"))


def collect(request: PsRequest) -> Agents:
    """This node's agents, as ``request`` asks."""
    records = list_records()
    if request.job:
        records = [r for r in records if r.job_id == request.job]
    found = agent_rows(records, request.timeout)
    failed = [r for r in found if r["state"] == "error"]
    code = errors.AgentError.exit_code if failed else 0
    messages = [f"agent of pid {r['pid']}: {printable(r['error'])}" for r in failed]
    return Agents(exit_code=code, messages=messages, agents=found, job=request.job)


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Every node's agents (the ``ps`` action with ``options`` on each), in rank order."""
    request = PsRequest.from_json(options)
    answers = reach.client.action_all(nodes, "ps", options, timeout=request.timeout + 1.0)
    labels = node_labels(nodes)
    agents = []
    for a in answers:
        got = read(a, Agents.from_json)
        for row in got.agents if got is not None else []:
            row["node"] = labels[a.node]
            agents.append(row)
    agents.sort(key=rank_key)
    doc = {**envelope(answers, strip=("agents",)), "agents": agents}
    return JobResult(doc, exit_code(answers), node_messages(answers))
