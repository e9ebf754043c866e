"""List the artifacts in the store, newest first.

Artifacts still being written are not listed as finished; `--all` shows them as `writing`,
and temporary directories left by a writer that died as `stale` (the next capture removes
them). A directory whose manifest is damaged, or an entry that is a link, is skipped and
reported on stderr. A store root that is not dynprof's (no `.dynprof-store` marker and other
entries in it) is refused with the reason; nothing outside the store is walked.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynprof.cli._common import bounded_int, human_bytes, printable, table
from dynprof.cli.job import (
    JobCommand,
    JobResult,
    Reach,
    Text,
    answered_count,
    envelope,
    exit_code,
    fetched_doc,
    node_messages,
    with_fetch,
)
from dynprof.node_requests import MAX_LIMIT, LsRequest
from dynprof.nodes import Node
from dynprof.result import Result
from dynprof.store import ArtifactStore

LS_TIMEOUT_S = 30.0


class LsCommand(JobCommand):
    """List the artifacts in the store, newest first."""

    name = "ls"
    takes_fetch = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job's artifacts")
        parser.add_argument("--kind", help="only this kind (trace, stacks, memory, healthcheck, ...)")
        parser.add_argument(
            "--limit", type=bounded_int(0, MAX_LIMIT), default=0, help="show at most this many (default: all)"
        )
        parser.add_argument("--all", action="store_true", help="also list artifacts still being written")

    def collect_local(self, args: argparse.Namespace) -> Result:
        return self.collect_request(request_from_args(args), name_skipped=not getattr(args, "json", False))

    def collect_request(self, request: LsRequest, name_skipped: bool = False) -> Result:
        """This node's artifacts, as ``request`` asks (``name_skipped``: the text view names the
        entries it skipped on stderr; the JSON document lists them)."""
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
        rows = [
            (t.id, t.kind, "stale" if t.stale else "writing", t.rank, f"{t.age_s:.0f} s ago", human_bytes(t.size))
            for t in temps
        ]
        return JobResult(doc, 0, messages, context={"temporaries": rows})

    def action_requests(self) -> dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[[Any], Result]]]:
        """The sidecar's ``ls`` action read as its request (an action answers JSON: nothing is
        named on stderr)."""
        return {"ls": (LsRequest.from_json, self.collect_request)}

    def collect_job(self, options: dict[str, Any], nodes: list[Node], reach: Reach) -> Result:
        from dynprof.job.answers import node_labels, rows
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

    def render(self, result: Result) -> str:
        doc = result.to_json()
        if "nodes" in doc:
            return _render_nodes(doc)
        temps = result.context.get("temporaries", []) if isinstance(result, JobResult) else []
        arts = doc["artifacts"]
        if not arts and not temps:
            return f"no artifacts in {printable(doc['root'])}"
        rows = [
            (
                a["id"],
                a["kind"],
                a["status"],
                a["rank"] if a["rank"] is not None else "-",
                a["created_at"],
                human_bytes(a["bytes"]),
            )
            for a in arts
        ]
        return (
            table(rows + temps, ["ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"])
            + f"\n\n{len(arts)} artifact(s) in {printable(doc['root'])}"
        )


def request_from_args(args: argparse.Namespace) -> LsRequest:
    """The options of `dynprof ls` on this node as its request."""
    return LsRequest(job=args.job, kind=args.kind, limit=args.limit, all=bool(args.all))


def _render_nodes(doc: dict[str, Any]) -> str:
    rows = doc["artifacts"]
    text = Text()
    text.print(
        table(
            [
                (
                    r["node"],
                    r.get("id"),
                    r.get("kind"),
                    r.get("status"),
                    r.get("rank") if r.get("rank") is not None else "-",
                    r.get("created_at"),
                    human_bytes(r["bytes"]) if isinstance(r.get("bytes"), int) else "-",
                )
                for r in rows
            ],
            ["NODE", "ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"],
        )
    )
    text.print(f"\n{len(rows)} artifact(s) on {answered_count(doc)} node(s)")
    text.artifacts([], doc.get("fetched"))
    text.footer(doc)
    return text.value()
