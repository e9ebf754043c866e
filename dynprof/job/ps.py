"""``ps``: the dynprof agents of this node (:func:`collect`), or of a whole job's nodes, merged
in rank order (:func:`collect_job`). ``dynprof ps`` and the sidecar's ``ps`` action answer
with these."""

from __future__ import annotations

from typing import Any

from dynprof import errors
from dynprof.agents import agent_rows
from dynprof.job.answers import node_labels, rank_key, rows
from dynprof.job.merge import JobResult, Reach, envelope, exit_code, node_messages
from dynprof.node_requests import PsRequest
from dynprof.nodes import Node
from dynprof.output import printable
from dynprof.registry import list_records


def collect(request: PsRequest) -> JobResult:
    """This node's agents, as ``request`` asks."""
    records = list_records()
    if request.job:
        records = [r for r in records if r.job_id == request.job]
    found = agent_rows(records, request.timeout)
    failed = [r for r in found if r["state"] == "error"]
    code = errors.AgentError.exit_code if failed else 0
    messages = [f"agent of pid {r['pid']}: {printable(r['error'])}" for r in failed]
    return JobResult({"agents": found}, code, messages, context={"job": request.job})


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Every node's agents (the ``ps`` action with ``options`` on each), in rank order."""
    request = PsRequest.from_json(options)
    answers = reach.client.action_all(nodes, "ps", options, timeout=request.timeout + 1.0)
    labels = node_labels(nodes)
    agents = []
    for a in answers:
        for row in rows(a, "agents"):
            row["node"] = labels[a.node]
            agents.append(row)
    agents.sort(key=rank_key)
    doc = {**envelope(answers, strip=("agents",)), "agents": agents}
    return JobResult(doc, exit_code(answers), node_messages(answers))
