"""``memory``: this node's CUDA memory snapshots or allocator history switch (:func:`collect`),
its optimizer-step plans (:func:`collect_plan`); a whole job's snapshots, rank by rank, are
the job layer's per-rank merge of the nodes' answers, each read with
:meth:`MemoryResults.from_json` (the sidecar's ``memory`` row names it).
``dynprof memory`` and the sidecar's ``memory`` and ``memory-plan`` actions answer with these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from collectors.memory import collect as kind
from collectors.memory.collect import MemoryPlanRequest, MemoryRequest
from dynprof import errors
from dynprof.job.answers import ProcessResults, answer_rows, as_list
from dynprof.result import Result

PLAN_SCHEMA = 1
MAX_NOTE_CHARS = 2000  # a note read back from a node's answer


@dataclass
class MemoryResults(ProcessResults):
    """This node's answer (``dynprof memory --json``, the sidecar's ``memory`` action):
    ``{"results": [one row per process]}``, read back with
    :meth:`~dynprof.job.answers.ProcessResults.from_json`; ``history`` says whether it answers a
    history request (``--history-start``/``--history-stop``) or a snapshot (for its text only:
    the document does not say)."""

    history: bool = False
    WHAT: ClassVar[str] = "memory"


@dataclass
class MemoryPlanResults(Result):
    """``dynprof memory plan``: ``{"schema": 1, "results": [one row per process, with its plan],
    "jobs": [one plan per group of a job's ranks that agree, with each rank's figures],
    "notes": [what is worth saying besides]}``."""

    results: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``dynprof memory plan --json`` on one node, the sidecar's ``memory-plan`` answer."""
        return {"schema": PLAN_SCHEMA, "results": self.results, "jobs": self.jobs, "notes": self.notes}

    @classmethod
    def from_json(cls, doc: Any) -> MemoryPlanResults:
        """A node's answer, untrusted: an object of ``schema`` 1 with a list ``results`` (its
        rows that are objects kept, as they are), else :class:`~dynprof.errors.ArtifactError`;
        ``jobs`` (its objects) and ``notes`` (each a line of at most :data:`MAX_NOTE_CHARS`)
        left empty when missing or not lists."""
        results = answer_rows(doc, "results", "memory plan")
        if doc.get("schema") != PLAN_SCHEMA or isinstance(doc.get("schema"), bool):
            raise errors.ArtifactError(f"the memory plan answer is not of schema {PLAN_SCHEMA}")
        notes = [str(n)[:MAX_NOTE_CHARS] for n in as_list(doc.get("notes"))]
        return cls(
            messages=list(notes),
            results=results,
            jobs=[dict(j) for j in as_list(doc.get("jobs")) if isinstance(j, dict)],
            notes=notes,
        )


def collect(request: MemoryRequest, raise_single: bool = False) -> MemoryResults:
    """This node's answer to ``request`` (``raise_single``: one process only, and it
    failed: its error, as the text view says it)."""
    got = kind.collect(request)
    if raise_single and len(got.results) == 1 and got.failures:
        raise got.failures[0]
    return MemoryResults(exit_code=got.exit_code, results=got.results, history=request.history)


def collect_plan(request: MemoryPlanRequest, raise_single: bool = False) -> MemoryPlanResults:
    """This node's plans for ``request`` (``raise_single`` as :func:`collect`)."""
    got = kind.collect_plan(request)
    if raise_single and len(got.results) == 1 and got.failures:
        raise got.failures[0]
    return MemoryPlanResults(
        exit_code=got.exit_code, messages=list(got.notes), results=got.results, jobs=got.jobs, notes=got.notes
    )
