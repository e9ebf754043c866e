"""``ls``: the artifacts of this node's store (:func:`collect`), or of a whole job's nodes,
newest first (:func:`collect_job`, copied here with ``Reach.fetch``). ``dynprof ls`` and the
sidecar's ``ls`` action answer with these."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof.job.answers import answer_rows, as_list, node_labels, read
from dynprof.job.merge import JobResult, Reach, envelope, exit_code, fetched_doc, node_messages, with_fetch
from dynprof.node_requests import LsRequest
from dynprof.nodes import Node
from dynprof.output import printable
from dynprof.result import Result
from dynprof.store import ArtifactStore
from dynprof.units import human_bytes

LS_TIMEOUT_S = 30.0


@dataclass
class Listing(Result):
    """One node's ``ls`` answer: the store's ``root``, a row per artifact (``artifacts``: id,
    path, kind, status, job, host, rank, pid, created_at, bytes), the directories still being
    written (``writing``) and those a dead writer left (``stale``), the entries skipped with
    why (``bad``: path, reason); and, for its text only, the temporaries' table rows
    (``temporaries``: id, kind, state, rank, age, size)."""

    root: str = ""
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    writing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    bad: list[dict[str, Any]] = field(default_factory=list)
    temporaries: list[tuple[Any, ...]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``dynprof ls --json`` on one node, the sidecar's ``ls`` answer."""
        return {
            "root": self.root,
            "artifacts": self.artifacts,
            "writing": self.writing,
            "stale": self.stale,
            "bad": self.bad,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Listing:
        """A node's answer, untrusted: an object with a list ``artifacts`` (its rows that are
        objects kept, as they are; else :class:`~dynprof.errors.ArtifactError`); ``root`` a
        string, ``writing`` and ``stale`` lists of strings and ``bad`` a list of objects, each
        left empty when missing or of another type, its entries of another type left out."""
        artifacts = answer_rows(doc, "artifacts", "ls")
        root = doc.get("root")
        writing, stale, bad = (as_list(doc.get(key)) for key in ("writing", "stale", "bad"))
        return cls(
            root=root if isinstance(root, str) else "",
            artifacts=artifacts,
            writing=[p for p in writing if isinstance(p, str)],
            stale=[p for p in stale if isinstance(p, str)],
            bad=[dict(b) for b in bad if isinstance(b, dict)],
        )


def collect(request: LsRequest, name_skipped: bool = False) -> Listing:
    """This node's artifacts, as ``request`` asks (``name_skipped``: the text view names the
    entries it skipped on stderr; the JSON document lists them, and an action answers JSON:
    nothing is named on stderr)."""
    store = ArtifactStore()
    arts, bad = store.scan(job=request.job, kind=request.kind)
    if request.limit:
        arts = arts[: request.limit]
    temps = store.temporaries() if request.all else []
    messages = [f"skipped {printable(b.id)}: {printable(b.reason)}" for b in bad] if name_skipped else []
    return Listing(
        exit_code=0,
        messages=messages,
        root=str(store.root),
        artifacts=[
            {
                "id": a.id,
                "path": str(a.path),
                "kind": a.kind,
                "status": a.status,
                "job": a.manifest.get("job"),
                "host": a.manifest.get("host"),
                "rank": a.manifest.get("rank"),
                "pid": a.manifest.get("pid"),
                "created_at": a.created_at,
                "bytes": a.size,
            }
            for a in arts
        ],
        writing=[str(t.path) for t in temps if not t.stale],
        stale=[str(t.path) for t in temps if t.stale],
        bad=[{"path": str(b.path), "reason": b.reason} for b in bad],
        temporaries=[
            (t.id, t.kind, "stale" if t.stale else "writing", t.rank, f"{t.age_s:.0f} s ago", human_bytes(t.size))
            for t in temps
        ],
    )


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Every node's artifacts (the ``ls`` action with ``options`` on each, read with
    :meth:`Listing.from_json`), newest first."""
    from dynprof.job.fetch import fetch

    request = LsRequest.from_json(options)
    client = reach.client
    answers = client.action_all(nodes, "ls", options, timeout=LS_TIMEOUT_S)
    labels = node_labels(nodes)
    found: list[tuple[Node, dict[str, Any]]] = []
    for a in answers:
        got = read(a, Listing.from_json)
        for row in got.artifacts if got is not None else []:
            row["node"] = labels[a.node]
            found.append((a.node, row))
    found.sort(
        key=lambda nr: (str(nr[1].get("created_at") or ""), str(nr[1].get("id") or "").rsplit("/", 1)[-1]),
        reverse=True,
    )
    if request.limit:
        found = found[: request.limit]  # each node kept its newest; the newest of all remain
    fetched = fetch(client, Path(reach.fetch), [(n, row.get("id")) for n, row in found]) if reach.fetch else None
    doc = {
        **envelope(answers, strip=("artifacts",)),
        "artifacts": [row for _, row in found],
        **fetched_doc(fetched),
    }
    return JobResult(doc, with_fetch(exit_code(answers), fetched), node_messages(answers))
