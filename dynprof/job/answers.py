"""Reading the nodes' answers: every value in them is untrusted, so each is taken only when it
has the type the merges expect (a list of objects, an int that is not a bool), and nodes are
named as output names them.

A kind's answer reads itself (its ``from_json``); :func:`answer_rows` is the part those
readers share (the list of objects under one key), and :func:`read` asks a node's answer for
its decoded form, ``None`` when the node gave none that reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dynprof import errors
from dynprof.result import Result

if TYPE_CHECKING:  # the HTTP client is imported only where nodes are asked
    from dynprof.nodes import Node, NodeAnswer

T = TypeVar("T")
R = TypeVar("R", bound="ProcessResults")


def answer_rows(doc: Any, key: str, what: str) -> list[dict[str, Any]]:
    """The list ``key`` of the answer ``doc`` of ``what`` (``"ps"``, ``"stop"``, ...): its objects,
    copied (an entry that is not an object is left out, as the merges always did). Raises
    :class:`~dynprof.errors.ArtifactError` when ``doc`` is not an object or ``key`` not a list."""
    if not isinstance(doc, dict):
        raise errors.ArtifactError(f"the {what} answer is not a JSON object")
    found = doc.get(key)
    if not isinstance(found, list):
        raise errors.ArtifactError(f"the {what} answer has no list {key!r}")
    return [dict(r) for r in found if isinstance(r, dict)]


@dataclass
class ProcessResults(Result):
    """A node's answer of one row per process (``results``: pid, rank, status, artifact,
    error, ...), as ``stop`` and ``memory`` answer; ``WHAT`` names the answer in an error."""

    results: list[dict[str, Any]] = field(default_factory=list)
    WHAT: ClassVar[str] = "node's"

    def to_json(self) -> dict[str, Any]:
        """The answer's document: ``{"results": [...]}``."""
        return {"results": self.results}

    @classmethod
    def from_json(cls: type[R], doc: Any) -> R:
        """A node's answer, untrusted: an object with a list ``results`` (its rows that are
        objects kept, as they are); else :class:`~dynprof.errors.ArtifactError`."""
        return cls(results=answer_rows(doc, "results", cls.WHAT))

    def rank_rows(self) -> list[dict[str, Any]]:
        """The rows a job-wide answer merges rank by rank (:func:`dynprof.job.merge.per_rank_result`)."""
        return self.results

    def artifact_paths(self) -> list[Any]:
        return [r.get("artifact") for r in self.results]


def read(answer: NodeAnswer, decode: Callable[[Any], T]) -> T | None:
    """A node's answer as ``decode`` (a kind's ``from_json``) reads it; ``None`` when the node did
    not answer or its answer does not read (an error document, a malformed one)."""
    if not answer.answered:
        return None
    try:
        return decode(answer.result)
    except errors.ArtifactError:
        return None


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_key(row: dict[str, Any]) -> tuple[str, int, str, int]:
    """Rows of many nodes in job, rank, node, pid order (rows without a rank last)."""
    rank = int_or_none(row.get("rank"))
    pid = int_or_none(row.get("pid"))
    return (str(row.get("job") or ""), rank if rank is not None else 1 << 30, str(row.get("node")), pid or 0)


def node_labels(nodes: list[Node]) -> dict[Node, str]:
    """How output names a node: its host, or host:port where several nodes share a host."""
    counts = Counter(n.host for n in nodes)
    return {n: (n.host if counts[n.host] == 1 else n.address) for n in nodes}
