"""`dynprof memory-report`: an offline report of a CUDA memory snapshot."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.memory import KIND, SNAPSHOT_FILE, SUMMARY_FILE
from collectors.memory.reader import max_snapshot_bytes, parse_snapshot, read_snapshot_file
from collectors.memory.render import format_summary, render_html
from collectors.memory.summary import summarize_snapshot
from dynprof import errors
from dynprof.cli._common import add_json, bounded_int, path_arg, printable_lines
from dynprof.result import Result
from dynprof.store import MANIFEST, Artifact, ArtifactStore

EMBED_PICKLE_MAX = 20 * 1024 * 1024
log = logging.getLogger("dynprof.cli")


@dataclass
class MemoryReport(Result):
    """The report's ``--json`` document (``source``, ``html``, ``torch_viz``, ``summary``), with
    what its text needs besides: the snapshot's path (named in an error) and ``--top``."""

    source: Path = field(default_factory=Path)
    top: int = 10


class MemoryReportCommand:
    """Summarise a CUDA memory snapshot and write a self-contained HTML report.

    dynprof memory-report ARTIFACT_OR_PICKLE [-o report.html]

    ARTIFACT_OR_PICKLE is a `memory` artifact (path, id or end of an id from `dynprof ls`) or any
    snapshot pickle (torch.cuda.memory._dump_snapshot). The summary is printed; the HTML opens
    without network access. --torch-viz also writes PyTorch's own interactive viewer page, which
    loads its scripts from a CDN when opened.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "source", type=path_arg, metavar="ARTIFACT_OR_PICKLE", help="memory artifact or snapshot pickle"
        )
        parser.add_argument(
            "-o",
            "--output",
            type=path_arg,
            metavar="OUT.html",
            help="where to write the HTML report (default: memory-report-<name>.html here)",
        )
        parser.add_argument("--no-html", action="store_true", help="only print the summary")
        parser.add_argument(
            "--torch-viz",
            type=path_arg,
            metavar="FILE.html",
            help="also write torch.cuda._memory_viz.trace_plot's page (needs internet to open)",
        )
        parser.add_argument(
            "--top", type=bounded_int(1, 100_000), default=10, help="rows in the site and block tables (default 10)"
        )
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        pickle_path, artifact = _locate(args.source)
        if artifact is not None:  # only the artifact's own file, never through a link
            data = artifact.read_bytes(SNAPSHOT_FILE, max_snapshot_bytes())
        else:
            data = read_snapshot_file(pickle_path)
        snapshot = parse_snapshot(data, str(pickle_path))
        try:
            summary = summarize_snapshot(snapshot, top=args.top)
        except (TypeError, AttributeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as exc:
            raise _malformed(pickle_path, exc) from None
        if artifact is not None:  # what the capture knew beyond the snapshot: trigger, OOM, free/total
            if artifact.has_file(SUMMARY_FILE):
                try:
                    captured = artifact.read_json(SUMMARY_FILE)
                    if not isinstance(captured, dict):
                        captured = {}
                    for key in (
                        "trigger",
                        "memory_history",
                        "torch_version",
                        "failing_allocation",
                        "device_memory",
                        "capture",
                    ):
                        if key in captured:
                            summary[key] = captured[key]
                except errors.ArtifactError:
                    pass
        html_path = None
        if not args.no_html:
            name = artifact.path.name if artifact is not None else pickle_path.stem
            html_path = Path(args.output) if args.output else Path.cwd() / f"memory-report-{name}.html"
            try:
                page = render_html(
                    snapshot,
                    summary,
                    title=f"CUDA memory: {name}",
                    source=str(pickle_path),
                    pickle_bytes=data if len(data) <= EMBED_PICKLE_MAX else None,
                )
            except (TypeError, AttributeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as exc:
                raise _malformed(pickle_path, exc) from None
            try:
                html_path.write_text(page)
            except OSError as exc:
                raise errors.DynprofError(
                    f"cannot write {html_path}: {exc}", help="Give a writable path with -o."
                ) from None
        viz_path = None
        if args.torch_viz:
            viz_path = Path(args.torch_viz)
            try:
                from torch.cuda import _memory_viz  # type: ignore[attr-defined]
            except Exception as exc:
                raise errors.Unsupported(f"--torch-viz needs torch here: {type(exc).__name__}: {exc}") from None
            trace_plot: Any = _memory_viz.trace_plot
            try:
                viz_path.write_text(trace_plot(snapshot))
            except OSError as exc:
                raise errors.DynprofError(
                    f"cannot write {viz_path}: {exc.strerror or exc}", help="Give a writable path to --torch-viz."
                ) from None
        return MemoryReport(
            doc={
                "source": str(pickle_path),
                "html": str(html_path) if html_path else None,
                "torch_viz": str(viz_path) if viz_path else None,
                "summary": summary,
            },
            source=pickle_path,
            top=args.top,
        )

    def render(self, result: Result) -> str:
        assert isinstance(result, MemoryReport)
        summary = result.doc["summary"]
        # Frame names, file names and devices come from the pickle: shown escaped.
        try:
            text = format_summary(summary, top=result.top)
        except (TypeError, AttributeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as exc:
            raise _malformed(result.source, exc) from None
        lines = [printable_lines(text)]
        if not summary.get("history_recorded"):
            lines.append(
                "\nnote: no allocation history or stacks in this snapshot (memory history was off in the process)"
            )
        if result.doc["html"]:
            lines.append(f"\nHTML report: {result.doc['html']}")
        if result.doc["torch_viz"]:
            lines.append(
                f"PyTorch's interactive viewer: {result.doc['torch_viz']} (loads its scripts from cdn.jsdelivr.net when opened)"
            )
        return "\n".join(lines)


def _malformed(path: Path, exc: BaseException) -> errors.ArtifactError:
    """A snapshot whose segments, blocks or traces are not what PyTorch writes; Python's text of
    the failure goes to the debug log, the person gets what is wrong and what to do."""
    log.debug("summarising %s failed", path, exc_info=exc)
    return errors.ArtifactError(
        f"{path} is not a well-formed PyTorch memory snapshot: its segments, blocks or device traces "
        "hold values of the wrong type or shape (a damaged file, or a pickle of something else)",
        help="Give a snapshot written by `dynprof memory` or torch.cuda.memory._dump_snapshot(); "
        "`dynprof show --verify` checks an artifact's files against its manifest.",
    )


def _locate(source: str) -> tuple[Path, Artifact | None]:
    path = Path(source).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
        has_manifest = is_dir and os.path.lexists(path / MANIFEST)
        exists = path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte
        is_file = is_dir = has_manifest = exists = False
    if is_file and path.name != MANIFEST:
        return path, None
    if is_dir and not has_manifest:
        if (path / SNAPSHOT_FILE).exists():
            return path / SNAPSHOT_FILE, None
        raise errors.ArtifactError(
            f"{path} is a directory without a {SNAPSHOT_FILE}",
            help="Give a memory artifact (`dynprof ls --kind memory`) or a snapshot pickle.",
        )
    try:
        artifact = ArtifactStore().get(source)
    except OSError as exc:  # a name the filesystem refuses (too long, say)
        raise errors.ArtifactError(f"{source!a}: no such file or artifact ({exc.strerror or exc})") from None
    except errors.ArtifactError:
        if not exists:
            raise errors.ArtifactError(
                f"{source}: no such file or artifact",
                help="Give a memory artifact (`dynprof ls --kind memory`) or a snapshot pickle.",
            ) from None
        raise
    if artifact.kind != KIND:
        raise errors.ArtifactError(
            f"{artifact.path} is a {artifact.kind!r} artifact, not a memory snapshot",
            help="List memory artifacts with `dynprof ls --kind memory`.",
        )
    if artifact.status == "failed":
        raise errors.ArtifactError(f"{artifact.path}: the capture failed ({artifact.manifest.get('error')})")
    return artifact.file(SNAPSHOT_FILE), artifact
