"""List the artifacts in the store, newest first.

Artifacts still being written are not listed as finished; `--all` shows them as `writing`,
and temporary directories left by a writer that died as `stale` (the next capture removes
them). A directory whose manifest is damaged, or an entry that is a link, is skipped and
reported on stderr. A store root that is not dynprof's (no `.dynprof-store` marker and other
entries in it) is refused with the reason; nothing outside the store is walked.
"""

from __future__ import annotations

import argparse
import sys

from dynprof.cli._common import add_json, bounded_int, human_bytes, print_json, printable, table
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.store import ArtifactStore


class LsCommand:
    """List the artifacts in the store, newest first."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job's artifacts")
        parser.add_argument("--kind", help="only this kind (trace, stacks, memory, healthcheck, ...)")
        parser.add_argument(
            "--limit", type=bounded_int(0, 10**9), default=0, help="show at most this many (default: all)"
        )
        parser.add_argument("--all", action="store_true", help="also list artifacts still being written")
        add_json(parser)
        add_many_node_args(parser, fetch=True)

    def run(self, args: argparse.Namespace) -> int:
        nodes = nodes_requested(args)
        if nodes is not None:
            from dynprof.cli import _many_nodes

            return _many_nodes.ls(args, nodes)
        store = ArtifactStore()
        arts, bad = store.scan(job=args.job, kind=args.kind)
        if args.limit:
            arts = arts[: args.limit]
        temps = store.temporaries() if args.all else []
        writing = [str(t.path) for t in temps if not t.stale]
        if args.json:
            print_json(
                {
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
                    "writing": writing,
                    "stale": [str(t.path) for t in temps if t.stale],
                    "bad": [{"path": str(b.path), "reason": b.reason} for b in bad],
                }
            )
            return 0
        for b in bad:
            print(f"dynprof: skipped {printable(b.id)}: {printable(b.reason)}", file=sys.stderr)
        if not arts and not temps:
            print(f"no artifacts in {printable(store.root)}")
            return 0
        rows = [
            (
                a.id,
                a.kind,
                a.status,
                a.manifest.get("rank") if a.manifest.get("rank") is not None else "-",
                a.created_at,
                human_bytes(a.size),
            )
            for a in arts
        ]
        rows += [
            (t.id, t.kind, "stale" if t.stale else "writing", t.rank, f"{t.age_s:.0f} s ago", human_bytes(t.size))
            for t in temps
        ]
        print(table(rows, ["ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"]))
        print(f"\n{len(arts)} artifact(s) in {printable(store.root)}")
        return 0
