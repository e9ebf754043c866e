"""Show one artifact: its manifest, its files, and a summary of its contents.

ARTIFACT is a path, an id from `dynprof ls`, or the last part of an id.

Artifacts are untrusted input: only files inside the artifact's directory are read (never
through a link), with size and depth limits, and control characters from its manifest are
not sent to the terminal. Inside the store an entry reached through a link is refused, by id
or by path; a directory outside the store, named by its path, is read as given.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from typing import Any

from dynprof import errors
from dynprof.cli._common import add_json, human_bytes, printable_lines
from dynprof.result import Result
from dynprof.store import Artifact, ArtifactStore

log = logging.getLogger("dynprof.cli")

# kind -> "module:function" rendering an artifact's contents. The function takes the Artifact
# and returns (summary dict for --json, text for people).
RENDERERS: dict[str, str] = {
    "trace": "collectors.torch_trace:render_artifact",
    "stacks": "collectors.stacks:render_artifact",
    "hang": "collectors.stacks:render_artifact",
    "memory": "collectors.memory.render:render_artifact",
    "host-memory": "collectors.host_memory:render_artifact",
    "nccl": "collectors.flight_recorder:render_artifact",
    "healthcheck": "healthcheck.report:render_artifact",
    "analysis": "collectors.trace_analysis:render_artifact",
}
# kind -> "module:function" returning an HTML fragment (self-contained, no script) that the web
# page shows above the text summary.
HTML_RENDERERS: dict[str, str] = {
    "analysis": "collectors.trace_analysis:render_html",
}


def _clean(value: object) -> str:
    """Text from a manifest, safe for a terminal (no escape sequences): newlines kept, other
    control characters and bidirectional overrides escaped, as everywhere in the CLI."""
    return printable_lines(str(value))


def render(artifact: Artifact) -> tuple[dict[str, Any] | None, str]:
    target = RENDERERS.get(artifact.kind)
    if target is None or artifact.status == "failed":
        return None, ""
    module_name, func = target.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), func)
    except (ImportError, AttributeError):
        return None, ""
    try:
        summary, text = fn(artifact)
    except Exception as exc:  # a damaged artifact must not hide its manifest
        message = _why_unreadable(artifact, exc)
        return {"error": message}, f"(cannot summarise the contents: {message})"
    return summary, text


def _why_unreadable(artifact: Artifact, exc: Exception) -> str:
    """What is wrong with the artifact's files, for a person: the readers' own errors say it;
    anything else (a value of the wrong type deep in a file) is named by the files, and
    Python's text of it goes to the debug log only."""
    if isinstance(exc, errors.DynprofError):
        return exc.message
    log.debug("rendering %s failed", artifact.path, exc_info=exc)
    names = ", ".join(str(f.get("name")) for f in artifact.files if isinstance(f, dict)) or "its files"
    return (
        f"{names} of this {artifact.kind} artifact hold(s) values of the wrong type or shape "
        f"(damaged, or not written by a dynprof {artifact.kind} capture); "
        "`dynprof show --verify` checks them against the manifest's checksums"
    )


def render_html(artifact: Artifact) -> str:
    """The kind's HTML fragment for the web page, or "" (no renderer, or it failed)."""
    target = HTML_RENDERERS.get(artifact.kind)
    if target is None or artifact.status == "failed":
        return ""
    module_name, func = target.split(":")
    try:
        return str(getattr(importlib.import_module(module_name), func)(artifact))
    except Exception:  # the text summary says what is wrong with the artifact
        return ""


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
