"""``ls``: the artifacts of this node's store (:func:`collect`), or of a whole job's nodes,
newest first (:func:`collect_job`, copied here with ``Reach.fetch``). ``dynprof ls`` and the
sidecar's ``ls`` action answer with these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynprof.job.answers import node_labels, rows
from dynprof.job.merge import JobResult, Reach, envelope, exit_code, fetched_doc, node_messages, with_fetch
from dynprof.node_requests import LsRequest
from dynprof.nodes import Node
from dynprof.output import printable
from dynprof.store import ArtifactStore
from dynprof.units import human_bytes

LS_TIMEOUT_S = 30.0


def collect(request: LsRequest, name_skipped: bool = False) -> JobResult:
    """This node's artifacts, as ``request`` asks (``name_skipped``: the text view names the
    entries it skipped on stderr; the JSON document lists them, and an action answers JSON:
    nothing is named on stderr)."""
    store = ArtifactStore()
    arts, bad = store.scan(job=request.job, kind=request.kind)
    if request.limit:
        arts = arts[: request.limit]
    temps = store.temporaries() if request.all else []
    doc = {
        "root": str(store.root),
        "artifacts": [
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
        "writing": [str(t.path) for t in temps if not t.stale],
        "stale": [str(t.path) for t in temps if t.stale],
        "bad": [{"path": str(b.path), "reason": b.reason} for b in bad],
    }
    messages = [f"skipped {printable(b.id)}: {printable(b.reason)}" for b in bad] if name_skipped else []
    temporaries = [
        (t.id, t.kind, "stale" if t.stale else "writing", t.rank, f"{t.age_s:.0f} s ago", human_bytes(t.size))
        for t in temps
    ]
    return JobResult(doc, 0, messages, context={"temporaries": temporaries})


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Every node's artifacts (the ``ls`` action with ``options`` on each), newest first."""
    from dynprof.job.fetch import fetch

    request = LsRequest.from_json(options)
    client = reach.client
    answers = client.action_all(nodes, "ls", options, timeout=LS_TIMEOUT_S)
    labels = node_labels(nodes)
    found: list[tuple[Node, dict[str, Any]]] = []
    for a in answers:
        for row in rows(a, "artifacts"):
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
