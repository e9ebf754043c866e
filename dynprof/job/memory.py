"""``memory``: this node's CUDA memory snapshots or allocator history switch (:func:`collect`),
its optimizer-step plans (:func:`collect_plan`), or a whole job's snapshots, rank by rank
(:func:`collect_job`). ``dynprof memory`` and the sidecar's ``memory`` and ``memory-plan``
actions answer with these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collectors.memory import collect as kind
from collectors.memory.collect import DEFAULT_TIMEOUT_S, MemoryPlanRequest, MemoryRequest
from dynprof.job.merge import JobResult, Reach, collect_per_rank
from dynprof.nodes import Node
from dynprof.result import Result


@dataclass
class MemoryResults(Result):
    """This node's answer: ``{"results": [one row per process]}``; ``history`` says whether it
    answers a history request (``--history-start``/``--history-stop``) or a snapshot."""

    history: bool = False


@dataclass
class MemoryPlanResults(Result):
    """``dynprof memory plan``: ``{"schema": 1, "results": [one row per process, with its plan],
    "jobs": [one plan per group of a job's ranks that agree, with each rank's figures]}``."""


def collect(request: MemoryRequest, raise_single: bool = False) -> MemoryResults:
    """This node's answer to ``request`` (``raise_single``: one process only, and it
    failed: its error, as the text view says it)."""
    got = kind.collect(request)
    if raise_single and len(got.results) == 1 and got.failures:
        raise got.failures[0]
    return MemoryResults(doc={"results": got.results}, exit_code=got.exit_code, history=request.history)


def collect_plan(request: MemoryPlanRequest, raise_single: bool = False) -> MemoryPlanResults:
    """This node's plans for ``request`` (``raise_single`` as :func:`collect`)."""
    got = kind.collect_plan(request)
    if raise_single and len(got.results) == 1 and got.failures:
        raise got.failures[0]
    doc = {"schema": 1, "results": got.results, "jobs": got.jobs, "notes": got.notes}
    return MemoryPlanResults(doc=doc, exit_code=got.exit_code, messages=list(got.notes))


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Every node's snapshots or history switch (the ``memory`` action with ``options``), rank by rank."""
    return collect_per_rank("memory", options, nodes, reach, DEFAULT_TIMEOUT_S)
