"""Print the stacks of running processes (or a core file), grouped by where they are.

    dynprof stacks --job JOB                 # every rank of a job, grouped by identical stack
    dynprof stacks --pid 4242,4243 --native  # any Python process, with or without an agent
    dynprof stacks --core core.4242 [--executable /usr/bin/python3]
    dynprof stacks --merge stacks.*.json       # one node's `stacks --json` per file, merged

Stacks are read from outside the process with py-spy (Python frames) or pystack (with
--native), so this works on a rank stuck in C code, holding the GIL, or stopped. When reading
from outside is refused (no CAP_SYS_PTRACE, Yama ptrace_scope, another user), the dynprof agent
inside the process answers instead, and the output says so and why. All targets are read in
parallel; one artifact holds every process's dump (text and JSON) and the merged view.

The merged view groups processes by the stack of their main thread, largest group first, and
for each other group names the frame where it departs from the largest one.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from collectors.stacks import (
    KIND,
    Budget,
    Source,
    Stacks,
    merge,
    read_document,
    render_merged,
    render_process,
    write_request_artifact,
)
from collectors.stacks.collect import METHODS, StacksRequest, collect
from dynprof import errors
from dynprof.cli._common import (
    add_targets,
    path_arg,
    printable,
    printable_lines,
    seconds,
    targets_from_args,
)
from dynprof.cli.job import JobCommand
from dynprof.job import stacks as stacks_job
from dynprof.job.merge import Reach
from dynprof.nodes import Node
from dynprof.result import Result
from dynprof.store import ArtifactStore
from dynprof.untrusted import open_regular


def read_stacks_file(path: str, budget: Budget) -> Stacks:
    """One node's ``stacks --json`` output (a stacks document): a regular file, read with the
    bounds of :func:`collectors.stacks.read_document` (``budget``: what all files of one merge
    may keep)."""
    with open_regular(path, "cannot open it", "not a regular file", errors.DynprofError) as fh:
        return read_document(fh, budget)


MAX_FAILURES_SHOWN = 10


def _failure_lines(failures: dict[str, str]) -> str:
    """The files (and nodes) that failed and why, one printable line each, for an error that
    ends a merge: the reason names the limit a file broke (its depth, its size), and the file."""
    if not failures:
        return ""
    shown = sorted(failures.items())[:MAX_FAILURES_SHOWN]
    lines = [f"\n  {printable(where)}: {printable(why)}" for where, why in shown]
    if len(failures) > len(shown):
        lines.append(f"\n  ... and {len(failures) - len(shown)} more")
    return ":" + "".join(lines)


def host_from_file_name(path: str) -> str | None:
    """``stacks.node-5.json`` -> ``node-5``: the node of an answer that does not name it."""
    name = os.path.basename(path)
    name = name.removesuffix(".json")
    name = name.removeprefix("stacks.").removeprefix("stacks-")
    return name or None


@dataclass
class StacksResult(Result):
    """The stacks document (``doc``), and what the text view says besides: ``view`` is
    ``local`` (read here), ``merge`` (files) or ``nodes`` (the nodes' answers)."""

    stacks: Stacks = field(default_factory=lambda: Stacks([]))
    view: str = "local"
    full: bool = False
    elapsed_s: float = 0.0
    artifact: str | None = None
    files_read: int = 0
    nodes: int = 0
    nodes_answered: int = 0
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    fetched: list[dict[str, Any]] | None = None


class StacksCommand(JobCommand):
    """Print the stacks of running processes (or a core file), grouped by where they are."""

    name: ClassVar[str] = "stacks"
    takes_fetch: ClassVar[bool] = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser, required=False)
        parser.add_argument(
            "--core", type=path_arg, metavar="CORE", help="read a core file (through pystack) instead of processes"
        )
        parser.add_argument(
            "--merge",
            nargs="+",
            type=path_arg,
            metavar="FILE",
            help="merge the `dynprof stacks --json` outputs of several nodes into one grouped view "
            "(a file that cannot be read is named and skipped)",
        )
        parser.add_argument(
            "--executable", type=path_arg, metavar="EXE", help="with --core: the Python executable that dumped it"
        )
        parser.add_argument("--native", action="store_true", help="include native (C/C++) frames")
        parser.add_argument("--locals", action="store_true", help="include local variables of each frame")
        parser.add_argument(
            "--method",
            choices=METHODS,
            default="auto",
            help="how to read: auto (py-spy, then pystack, then the agent), or one of them",
        )
        parser.add_argument(
            "--timeout",
            type=seconds,
            default=15.0,
            metavar="SEC",
            help="per-process limit for each reader (default 15)",
        )
        parser.add_argument("--no-save", action="store_true", help="print only; do not save an artifact")
        parser.add_argument("--full", action="store_true", help="also print every process's dump, all threads")

    # -- entry ---------------------------------------------------------------------------------
    def collect(self, args: argparse.Namespace) -> Result:
        if args.merge:
            return self.collect_merge(args)
        return super().collect(args)

    def collect_local(self, args: argparse.Namespace) -> Result:
        return self.collect_request(request_from_args(args), full=args.full)

    def collect_request(self, request: StacksRequest, full: bool = False) -> Result:
        """This node's answer to ``request`` (``full``: the text view prints every dump)."""
        got = collect(request)
        return StacksResult(
            doc=got.to_json(),
            exit_code=got.exit_code,
            stacks=got.stacks,
            full=full,
            elapsed_s=got.elapsed_s,
            artifact=got.artifact,
        )

    def collect_merge(self, args: argparse.Namespace) -> Result:
        """``--merge FILE...``: the no-sidecar path over many nodes (each node ran
        ``dynprof stacks --job J --json > stacks.$(hostname).json``)."""
        node_options = args.hosts is not None or args.hostfile or args.slurm is not None or args.discover
        if args.pid or args.job or args.all or args.core or node_options:
            raise errors.UsageError(
                "--merge reads files: it does not go with --pid, --job, --all, --core or the node options"
            )
        t0 = time.monotonic()
        sources: list[Source] = []
        failures: dict[str, str] = {}
        budget = Budget()
        for path in dict.fromkeys(args.merge):
            try:
                sources.append(Source(read_stacks_file(path, budget), host=host_from_file_name(path)))
            except errors.DynprofError as exc:
                failures[f"file {path}"] = exc.message
        if not sources:
            raise errors.DynprofError(
                f"no stacks to merge: none of the {len(args.merge)} file(s) could be read" + _failure_lines(failures),
                help="Each file must be the output of `dynprof stacks --json` (one per node).",
            )
        try:
            stacks = merge(sources)
        except errors.ArtifactError as exc:
            raise errors.DynprofError(f"cannot merge: {exc.message}") from None
        stacks.failures = {**failures, **stacks.failures}
        if not stacks.processes:
            raise errors.DynprofError(
                f"no process in the {len(sources)} file(s) read" + _failure_lines(stacks.failures),
                help="Each file must be the output of `dynprof stacks --json` (one per node).",
            )
        artifact = None if args.no_save else self._save_merged(args, stacks)
        elapsed = time.monotonic() - t0
        path = str(artifact.path) if artifact else None
        return StacksResult(
            doc={**stacks.to_json(), "artifact": path, "elapsed_s": round(elapsed, 3)},
            exit_code=1 if stacks.failures else 0,
            stacks=stacks,
            view="merge",
            elapsed_s=elapsed,
            artifact=path,
            files_read=len(sources),
        )

    def collect_job(self, options: dict[str, Any], nodes: list[Node], reach: Reach) -> Result:
        """Every node's stacks, merged (:func:`dynprof.job.stacks.collect_job`, which the
        sidecar's job-wide ``stacks`` action answers with too), for the text view."""
        got = stacks_job.collect_job(options, nodes, reach)
        return StacksResult(
            doc=got.to_json(),
            exit_code=got.exit_code,
            messages=got.messages,
            stacks=got.stacks,
            view="nodes",
            full=bool(options.get("full")),
            nodes=got.nodes,
            nodes_answered=got.nodes_answered,
            artifacts=got.artifacts,
            fetched=got.fetched,
        )

    # -- text ----------------------------------------------------------------------------------
    def render(self, result: Result) -> str:
        assert isinstance(result, StacksResult)
        s = result.stacks
        # Frames, file and thread names come from the targets: nothing in them reaches the terminal raw.
        lines: list[str] = []
        if s.processes:
            lines.append(printable_lines(render_merged(s.processes, s.groups)).removesuffix("\n"))
        elif result.view == "nodes":
            lines.append("no process read on any node")
        if result.full and result.view == "local":
            for p in s.processes:
                lines.append("")
                lines.append(printable_lines(render_process(p)))
        lines.extend(printable_lines(f"FAILED {who}: {why}") for who, why in s.failures.items())
        if result.view == "local":
            for p in s.processes:
                if p.fallback_help:
                    lines.append(f"  to read {p.label} from outside next time: {p.fallback_help}")
            saved = f"; artifact {result.artifact}" if result.artifact else ""
            lines.append(f"\n{len(s.processes)} process(es) read in {result.elapsed_s:.2f} s{saved}")
        elif result.view == "merge":
            saved = f"; artifact {result.artifact}" if result.artifact else ""
            hosts = len({p.host for p in s.processes})
            lines.append(
                f"\n{len(s.processes)} process(es) of {hosts} node(s) merged from {result.files_read} file(s){saved}"
            )
        else:
            if result.full:
                lines.append(
                    "every process's full dump (all threads) is in its node's stacks artifact: "
                    "--fetch DIR copies them here"
                )
            for art in result.artifacts:
                lines.append(printable(f"artifact on {art['node']}: {art['path']}"))
            for f in result.fetched or []:
                if f["error"]:
                    lines.append(printable(f"NOT FETCHED {f['id']} from {f['node']}: {f['error']}"))
                else:
                    lines.append(
                        printable(f"fetched {f['files']} file(s) of {f['id']} from {f['node']} into {f['path']}")
                    )
            lines.append(f"\n{len(s.processes)} process(es) read on {result.nodes_answered} of {result.nodes} node(s)")
        return "\n".join(lines)

    def _save_merged(self, args: argparse.Namespace, stacks: Stacks) -> Any:
        jobs = {p.job for p in stacks.processes if p.job}
        options = {"merged_files": [os.path.basename(f) for f in args.merge][:1000]}
        writer = ArtifactStore().create(KIND, job=jobs.pop() if len(jobs) == 1 else None, options=options)
        summary = write_request_artifact(writer, stacks.processes, stacks.failures)
        return writer.finish("partial" if stacks.failures else "complete", summary=summary)


def request_from_args(args: argparse.Namespace) -> StacksRequest:
    """The options of `dynprof stacks` (this node's processes, or a core file) as the kind's request."""
    return StacksRequest(
        **targets_from_args(args),
        core=args.core,
        executable=args.executable,
        native=args.native,
        locals=args.locals,
        method=args.method,
        timeout=args.timeout,
        save=not args.no_save,
    )
