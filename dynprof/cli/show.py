"""Show one artifact: its manifest, its files, and a summary of its contents.

ARTIFACT is a path, an id from `dynprof ls`, or the last part of an id.

Artifacts are untrusted input: only files inside the artifact's directory are read (never
through a link), with size and depth limits, and control characters from its manifest are
not sent to the terminal. Inside the store an entry reached through a link is refused, by id
or by path; a directory outside the store, named by its path, is read as given.
"""

from __future__ import annotations

import argparse
from typing import Any

from dynprof.cli._common import add_json, human_bytes, printable_lines
from dynprof.renderers import render
from dynprof.result import Result
from dynprof.store import Artifact, ArtifactStore


def _clean(value: object) -> str:
    """Text from a manifest, safe for a terminal (no escape sequences): newlines kept, other
    control characters and bidirectional overrides escaped, as everywhere in the CLI."""
    return printable_lines(str(value))


class ShowCommand:
    """Show one artifact: its manifest, its files, and a summary of its contents."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("artifact", metavar="ARTIFACT", help="path, id, or unique end of an id")
        parser.add_argument("--verify", action="store_true", help="check every file's size and sha256")
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        art = ArtifactStore().get(args.artifact)
        problems = art.verify() if args.verify else []
        summary, text = render(art)
        return ShownArtifact(art, summary, text, problems if args.verify else None)

    def render(self, result: Result) -> str:
        assert isinstance(result, ShownArtifact)
        art, problems = result.artifact, result.problems
        m = art.manifest
        lines = [f"{art.kind} artifact  {art.path}"]
        lines.append(f"  status   {art.status}" + (f"  ({m.get('error')})" if m.get("error") else ""))
        rank = m.get("rank")
        lines.append(
            f"  job      {m.get('job') or '-'}   host {m.get('host')}   rank {'-' if rank is None else rank}   pid {m.get('pid')}"
        )
        lines.append(f"  created  {m.get('created_at')}   finished {m.get('finished_at')}")
        opts = {k: v for k, v in (m.get("options") or {}).items() if v not in (None, False, 0, "", [])}
        if opts:
            lines.append("  options  " + ", ".join(f"{k}={v}" for k, v in opts.items()))
        for f in art.files:
            lines.append(f"  file     {f['name']}  {human_bytes(f['size'])}  sha256 {f['sha256'][:16]}…")
        if problems is not None:
            lines.append("  verify   " + ("ok" if not problems else "; ".join(problems)))
        out = "\n".join(_clean(line) for line in lines)
        if result.text:
            out += "\n\n" + _clean(result.text)
        return out


class ShownArtifact(Result):
    """One artifact: ``--json`` prints its path, manifest, contents (and verification)."""

    def __init__(
        self, artifact: Artifact, summary: dict[str, Any] | None, text: str, problems: list[str] | None
    ) -> None:
        super().__init__({}, 1 if problems else 0, [])
        self.artifact = artifact
        self.summary = summary
        self.text = text
        self.problems = problems  # None: not verified

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.artifact.path),
            "manifest": self.artifact.manifest,
            "contents": self.summary,
            **({"verify": self.problems or "ok"} if self.problems is not None else {}),
        }
