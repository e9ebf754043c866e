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
import json
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from collectors.stacks import Budget, Source, Stacks, merge, render_merged, render_process
from dynprof import errors
from dynprof.cli._common import (
    add_targets,
    parallel,
    path_arg,
    printable,
    printable_lines,
    resolve_agents,
    seconds,
)
from dynprof.cli.job import JobCommand
from dynprof.nodes import Node
from dynprof.registry import AgentRecord, read_record
from dynprof.result import Result

METHODS = ("auto", "py-spy", "pystack", "agent")


@dataclass
class Target:
    pid: int
    record: AgentRecord | None

    @property
    def rank(self) -> int | None:
        return self.record.rank if self.record is not None else None


def read_stacks_file(path: str, budget: Budget) -> Stacks:
    """One node's ``stacks --json`` output (a stacks document): a regular file, read with the
    bounds of :func:`collectors.stacks.read_document` (``budget``: what all files of one merge
    may keep)."""
    from collectors.stacks import read_document

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the merge
    except OSError as exc:
        raise errors.DynprofError(f"cannot open it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.DynprofError("not a regular file")
    with os.fdopen(fd, "rb") as fh:
        return read_document(fh, budget)


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
        chosen = [x for x in (args.pid, args.job, args.all, args.core) if x]
        if len(chosen) != 1:
            raise errors.UsageError(
                "give exactly one of --pid, --job, --all or --core", help="See `dynprof stacks --help`."
            )
        if args.executable and not args.core:
            raise errors.UsageError("--executable goes with --core")
        from collectors.stacks import ProcessStacks

        t0 = time.monotonic()
        failures: dict[str, str] = {}
        if args.core:
            processes = [self._core(args)]
        else:
            targets = self._targets(args)
            results = parallel(lambda t: self._capture(t, args), targets)
            processes = [r for r in results if isinstance(r, ProcessStacks)]
            failed = [(t, r) for t, r in zip(targets, results) if not isinstance(r, ProcessStacks)]
            for t, exc in failed:
                if not isinstance(exc, errors.DynprofError):
                    raise exc
                failures[f"pid {t.pid}" if t.rank is None else f"rank {t.rank} (pid {t.pid})"] = exc.message
            if not processes:
                # Nothing read: the error of the first target says what to do.
                raise failed[0][1]
        elapsed = time.monotonic() - t0
        stacks = merge([Source(Stacks(processes, failures=failures))])
        artifact = None if args.no_save else self._save(args, processes, failures)
        path = str(artifact.path) if artifact else None
        return StacksResult(
            doc={**stacks.to_json(), "artifact": path, "elapsed_s": round(elapsed, 3)},
            exit_code=1 if failures else 0,
            stacks=stacks,
            full=args.full,
            elapsed_s=elapsed,
            artifact=path,
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
                f"no stacks to merge: none of the {len(args.merge)} file(s) could be read",
                help="Each file must be the output of `dynprof stacks --json` (one per node).",
            )
        try:
            stacks = merge(sources)
        except errors.ArtifactError as exc:
            raise errors.DynprofError(f"cannot merge: {exc.message}") from None
        stacks.failures = {**failures, **stacks.failures}
        if not stacks.processes:
            raise errors.DynprofError(
                f"no process in the {len(sources)} file(s) read", help="See the failures each node reported."
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

    def collect_nodes(self, args: argparse.Namespace, nodes: list[Node]) -> Result:
        """Every node's sidecar reads its own ranks (``stacks`` there, :meth:`collect_local`);
        their answers are merged as files are, each process named with its node."""
        from collectors.stacks import from_json
        from dynprof.cli import job
        from dynprof.job.answers import node_labels

        client = self.client(args)
        options = job.forward_options("stacks", args)
        answers = client.action_all(nodes, "stacks", options, timeout=args.timeout + 5.0)
        labels = node_labels(nodes)
        sources: list[Source] = []
        failures: dict[str, str] = {}
        budget = Budget()
        for a in answers:
            label = labels[a.node]
            if not a.answered:
                failures[f"node {label}"] = a.error or "no answer"
                continue
            try:
                found = from_json(a.result, budget)
            except errors.ArtifactError as exc:
                why = (a.command_error() or f"exit code {a.exit_code}") if a.exit_code else exc.message
                failures[f"node {label}"] = why
                continue
            if a.exit_code and not found.processes:
                failures[f"node {label}"] = a.command_error() or f"exit code {a.exit_code}"
            sources.append(Source(found, node=label))
        try:
            stacks = merge(sources, by_host=True)
        except errors.ArtifactError as exc:
            raise errors.DynprofError(f"cannot merge: {exc.message}") from None
        stacks.failures = {**failures, **stacks.failures}
        stacks.processes.sort(
            key=lambda p: (p.job or "", p.rank if p.rank is not None else 1 << 30, p.host or "", p.pid)
        )
        artifacts = job.artifacts_of(answers, labels, lambda r: [r.get("artifact")])
        fetched = job.maybe_fetch(args, client, answers, artifacts)
        doc = {
            # Each node's processes and groups are in the merged lists (named by node): per_node keeps the rest.
            **job.envelope(answers, strip=("processes", "groups")),
            **stacks.to_json(),
            "artifacts": artifacts,
            **({"fetched": fetched} if fetched is not None else {}),
        }
        return StacksResult(
            doc=doc,
            exit_code=job.with_fetch(job.exit_code(answers), fetched),
            messages=job.node_messages(answers),
            stacks=stacks,
            view="nodes",
            full=args.full,
            nodes=len(nodes),
            nodes_answered=sum(a.answered for a in answers),
            artifacts=artifacts,
            fetched=fetched,
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

    # -- targets -------------------------------------------------------------------------------
    def _targets(self, args: argparse.Namespace) -> list[Target]:
        if args.pid:
            targets = []
            for pid in dict.fromkeys(args.pid):
                errors.probe_pid(pid)  # dead pid or zombie (3), another user's (4)
                record = read_record(pid)
                if record is not None and (record.pid != pid or not record.is_alive()):
                    record = None
                targets.append(Target(pid, record))
            return targets
        return [Target(r.pid, r) for r in resolve_agents(args)]

    # -- one process -------------------------------------------------------------------------
    def _capture(self, target: Target, args: argparse.Namespace) -> Any:
        from collectors.stacks import readers

        pid = target.pid
        attempts: list[str] = []
        refusal: str | None = None
        if args.method != "agent":
            refusal = readers.ptrace_refusal(pid)
            if refusal is None:
                capture = {"py-spy": readers.capture_py_spy, "pystack": readers.capture_pystack}
                order = (
                    [args.method]
                    if args.method != "auto"
                    else (["pystack", "py-spy"] if args.native else ["py-spy", "pystack"])
                )
                for name in order:
                    try:
                        result = capture[name](pid, native=args.native, locals=args.locals, timeout=args.timeout)
                    except readers.CaptureError as exc:
                        attempts.append(f"{exc.method} failed: {exc.reason}")
                        continue
                    return self._finish(result, target, attempts)
            else:
                attempts.append(refusal)
        if target.record is not None and args.method in ("auto", "agent"):
            try:
                result = self._from_agent(target, args)
            except errors.DynprofError as exc:
                gone = errors.process_gone(pid)
                if gone is not None:
                    raise errors.ProcessNotFound(f"process {pid} {gone} while its stacks were being read") from None
                if args.method == "agent":
                    raise  # the agent's own error (no agent, timed out...) says it best
                attempts.append(f"the agent could not answer: {exc.message}")
            else:
                if args.native:
                    result.notes.append("native frames are not available from inside the process")
                result = self._finish(result, target, attempts)
                if refusal is not None:
                    result.fallback_help = errors.PermissionDenied.default_help
                return result
        raise self._classify(pid, refusal, attempts, target.record is not None, args)

    def _finish(self, result: Any, target: Target, attempts: list[str]) -> Any:
        rec = target.record
        if rec is not None:
            result.rank, result.job, result.host = rec.rank, rec.job_id, rec.host
        else:
            import socket

            result.host = socket.gethostname()
        if attempts:
            result.fallback_reason = "; ".join(attempts)
        return result

    def _from_agent(self, target: Target, args: argparse.Namespace) -> Any:
        import os
        import tempfile

        from collectors.stacks import ProcessStacks
        from dynprof.client import AgentClient
        from dynprof.proto import pb

        assert target.record is not None
        client = AgentClient.for_record(target.record, timeout=min(args.timeout, 10.0))
        from dynprof.paths import run_dir

        # In the run directory: the agent writes only into dynprof's own places.
        with tempfile.TemporaryDirectory(prefix="stacks-", dir=run_dir()) as tmp:
            out = os.path.join(tmp, f"{target.pid}.json")
            client.request(dump_stacks=pb.DumpStacksRequest(all_threads=True, locals=args.locals, output_path=out))
            try:
                with open(out) as fh:
                    return ProcessStacks.from_json(json.load(fh))
            except (OSError, ValueError, RecursionError, errors.ArtifactError) as exc:
                raise errors.AgentError(
                    f"the agent of process {target.pid} left an unreadable stack dump: {type(exc).__name__}",
                    help=f"See the agent's log ({target.record.log or 'dynprof ps'}); "
                    "`--method py-spy` reads the stacks from outside.",
                ) from None

    def _classify(
        self, pid: int, refusal: str | None, attempts: list[str], has_agent: bool, args: argparse.Namespace
    ) -> errors.DynprofError:
        from collectors.stacks import readers

        detail = "; ".join(attempts)
        gone = errors.process_gone(pid)
        if gone is not None:
            # The readers' own messages ("Failed to get process executable name") say nothing useful.
            return errors.ProcessNotFound(f"process {pid} {gone} while its stacks were being read")
        if refusal is not None:
            hint = (
                ""
                if has_agent
                else (
                    " With the dynprof agent in the process, dynprof would ask it instead (attaching one "
                    "needs ptrace too): " + errors.LAUNCH_WITH_AGENT_HELP
                )
            )
            return errors.PtraceRefused(
                f"cannot read the stacks of pid {pid}: {detail}", help=errors.PermissionDenied.default_help + hint
            )
        if args.method == "agent" and not has_agent:
            return errors.NoAgent(f"process {pid} has no dynprof agent to ask (--method agent)")
        if readers.looks_like_python(pid) is False:
            return errors.NotPython(f"process {pid} ({_comm(pid)}) is not a Python process: {detail}")
        return errors.DynprofError(
            f"cannot read the stacks of pid {pid}: {detail}",
            help="Try --method pystack or --method py-spy, or a longer --timeout; "
            "check that py-spy and pystack are installed (`pip install py-spy pystack`).",
        )

    def _save_merged(self, args: argparse.Namespace, stacks: Stacks) -> Any:
        from collectors.stacks import KIND, write_request_artifact
        from dynprof.store import ArtifactStore

        jobs = {p.job for p in stacks.processes if p.job}
        options = {"merged_files": [os.path.basename(f) for f in args.merge][:1000]}
        writer = ArtifactStore().create(KIND, job=jobs.pop() if len(jobs) == 1 else None, options=options)
        summary = write_request_artifact(writer, stacks.processes, stacks.failures)
        return writer.finish("partial" if stacks.failures else "complete", summary=summary)

    # -- core files ------------------------------------------------------------------------------
    def _core(self, args: argparse.Namespace) -> Any:
        import os
        import stat

        from collectors.stacks import readers

        for what, path in (("core file", args.core), ("executable", args.executable)):
            if not path:
                continue
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                raise errors.DynprofError(f"no {what} {path}: {exc.strerror or exc}") from None
            if not stat.S_ISREG(mode):
                # pystack would block on a FIFO, or read a device for ever.
                raise errors.DynprofError(f"{what} {path} is not a regular file")
        try:
            return readers.capture_core(
                args.core, args.executable, native=args.native, locals=args.locals, timeout=max(args.timeout, 120.0)
            )
        except readers.CaptureError as exc:
            raise errors.DynprofError(
                f"cannot read core file {args.core}: {exc.reason}",
                help="Give the Python executable that produced it with --executable; the core must come from "
                "a Python process and the shared libraries it used must be present here.",
            ) from None

    # -- artifact ------------------------------------------------------------------------------
    def _save(self, args: argparse.Namespace, processes: list[Any], failures: dict[str, str]) -> Any:
        from collectors.stacks import KIND, write_request_artifact
        from dynprof.store import ArtifactStore

        jobs = {p.job for p in processes if p.job}
        job = args.job or (jobs.pop() if len(jobs) == 1 else None)
        options = {
            "native": args.native,
            "locals": args.locals,
            "method": args.method,
            "targets": [p.pid for p in processes],
            "core": args.core,
        }
        writer = ArtifactStore().create(KIND, job=job, options=options)
        summary = write_request_artifact(writer, processes, failures)
        return writer.finish("partial" if failures else "complete", summary=summary)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
