"""List the artifacts in the store, newest first.

Artifacts still being written are not listed as finished; `--all` shows them as `writing`,
and temporary directories left by a writer that died as `stale` (the next capture removes
them). A directory whose manifest is damaged, or an entry that is a link, is skipped and
reported on stderr. A store root that is not dynprof's (no `.dynprof-store` marker and other
entries in it) is refused with the reason; nothing outside the store is walked.
"""

from __future__ import annotations

import argparse
from typing import Any

from dynprof.cli._common import bounded_int, human_bytes, printable, table
from dynprof.cli.job import JobCommand, Text, answered_count
from dynprof.job import ls
from dynprof.node_requests import MAX_LIMIT, LsRequest
from dynprof.result import Result


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
        # the text view names the entries it skipped on stderr; the JSON document lists them
        return ls.collect(request_from_args(args), name_skipped=not getattr(args, "json", False))

    def render(self, result: Result) -> str:
        if not isinstance(result, ls.Listing):
            return _render_nodes(result.to_json())  # the job-wide answer
        arts, temps = result.artifacts, result.temporaries
        if not arts and not temps:
            return f"no artifacts in {printable(result.root)}"
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
            + f"\n\n{len(arts)} artifact(s) in {printable(result.root)}"
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
