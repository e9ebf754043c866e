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
from dataclasses import dataclass
from typing import Any

from dynprof import errors
from dynprof.cli._common import (
    add_json,
    add_targets,
    parallel,
    path_arg,
    print_json,
    printable_lines,
    resolve_agents,
    seconds,
)
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.registry import AgentRecord, read_record

METHODS = ("auto", "py-spy", "pystack", "agent")


@dataclass
class Target:
    pid: int
    record: AgentRecord | None

    @property
    def rank(self) -> int | None:
        return self.record.rank if self.record is not None else None


MAX_MERGE_FILE_BYTES = 64 << 20


def read_stacks_json(path: str) -> Any:
    """One node's ``stacks --json`` output: a regular file, bounded in size and depth."""
    from dynprof.untrusted import loads_json

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the merge
    except OSError as exc:
        raise errors.DynprofError(f"cannot open it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.DynprofError("not a regular file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_MERGE_FILE_BYTES + 1)
    if len(data) > MAX_MERGE_FILE_BYTES:
        raise errors.DynprofError(f"over {MAX_MERGE_FILE_BYTES >> 20} MiB")
    try:
        result = loads_json(data, "it")
    except errors.DynprofError as exc:
        raise errors.DynprofError(exc.message.removeprefix("it: ")) from None
    if not isinstance(result, dict) or not isinstance(result.get("processes"), list):
        raise errors.DynprofError("not the output of `dynprof stacks --json` (no list of processes)")
    return result


def host_from_file_name(path: str) -> str | None:
    """``stacks.node-5.json`` -> ``node-5``: the node of an answer that does not name it."""
    name = os.path.basename(path)
    name = name.removesuffix(".json")
    name = name.removeprefix("stacks.").removeprefix("stacks-")
    return name or None


class StacksCommand:
    """Print the stacks of running processes (or a core file), grouped by where they are."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
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
        add_json(parser)
        add_many_node_args(parser, fetch=True)

    # -- entry ---------------------------------------------------------------------------------
    def run(self, args: argparse.Namespace) -> int:
        if args.merge:
            return self._merge(args)
        nodes = nodes_requested(args)
        if nodes is not None:
            from dynprof.cli import _stacks_nodes

            return _stacks_nodes.stacks(args, nodes)
        from collectors import stacks as st

        chosen = [x for x in (args.pid, args.job, args.all, args.core) if x]
        if len(chosen) != 1:
            raise errors.UsageError(
                "give exactly one of --pid, --job, --all or --core", help="See `dynprof stacks --help`."
            )
        if args.executable and not args.core:
            raise errors.UsageError("--executable goes with --core")
        t0 = time.monotonic()
        failures: dict[str, str] = {}
        if args.core:
            processes = [self._core(args)]
        else:
            targets = self._targets(args)
            results = parallel(lambda t: self._capture(t, args), targets)
            processes = [r for r in results if isinstance(r, st.ProcessStacks)]
            failed = [(t, r) for t, r in zip(targets, results) if not isinstance(r, st.ProcessStacks)]
            for t, exc in failed:
                if not isinstance(exc, errors.DynprofError):
                    raise exc
                failures[f"pid {t.pid}" if t.rank is None else f"rank {t.rank} (pid {t.pid})"] = exc.message
            if not processes:
                # Nothing read: the error of the first target says what to do.
                raise failed[0][1]
        elapsed = time.monotonic() - t0
        groups = st.group_processes(processes)
        artifact = None if args.no_save else self._save(args, processes, failures)
        if args.json:
            print_json(
                {
                    "artifact": str(artifact.path) if artifact else None,
                    "elapsed_s": round(elapsed, 3),
                    "groups": [g.to_dict() for g in groups],
                    "processes": [
                        {
                            "pid": p.pid,
                            "rank": p.rank,
                            "method": p.method,
                            "native": p.native,
                            "fallback_reason": p.fallback_reason,
                            "fallback_help": p.fallback_help,
                            "threads": len(p.threads),
                            "job": p.job,
                            "host": p.host,
                            "main_thread": _main_thread_json(p),
                        }
                        for p in processes
                    ],
                    "failures": failures,
                }
            )
        else:
            # Frames, file and thread names come from the target: nothing in them reaches the terminal raw.
            print(printable_lines(st.render_merged(processes, groups)), end="")
            if args.full:
                for p in processes:
                    print()
                    print(printable_lines(st.render_process(p)))
            for who, why in failures.items():
                print(printable_lines(f"FAILED {who}: {why}"))
            for p in processes:
                if p.fallback_help:
                    print(f"  to read {p.label} from outside next time: {p.fallback_help}")
            print(
                f"\n{len(processes)} process(es) read in {elapsed:.2f} s"
                + (f"; artifact {artifact.path}" if artifact else "")
            )
        if failures:
            return 1
        return 0

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
        from collectors import stacks as st

        pid = target.pid
        attempts: list[str] = []
        refusal: str | None = None
        if args.method != "agent":
            refusal = st.ptrace_refusal(pid)
            if refusal is None:
                readers = {"py-spy": st.capture_py_spy, "pystack": st.capture_pystack}
                order = (
                    [args.method]
                    if args.method != "auto"
                    else (["pystack", "py-spy"] if args.native else ["py-spy", "pystack"])
                )
                for name in order:
                    try:
                        result = readers[name](pid, native=args.native, locals=args.locals, timeout=args.timeout)
                    except st.CaptureError as exc:
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
                    return ProcessStacks.from_dict(json.load(fh))
            except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
                raise errors.AgentError(
                    f"the agent of process {target.pid} left an unreadable stack dump: {type(exc).__name__}",
                    help=f"See the agent's log ({target.record.log or 'dynprof ps'}); "
                    "`--method py-spy` reads the stacks from outside.",
                ) from None

    def _classify(
        self, pid: int, refusal: str | None, attempts: list[str], has_agent: bool, args: argparse.Namespace
    ) -> errors.DynprofError:
        from collectors import stacks as st

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
        if st.looks_like_python(pid) is False:
            return errors.NotPython(f"process {pid} ({_comm(pid)}) is not a Python process: {detail}")
        return errors.DynprofError(
            f"cannot read the stacks of pid {pid}: {detail}",
            help="Try --method pystack or --method py-spy, or a longer --timeout; "
            "check that py-spy and pystack are installed (`pip install py-spy pystack`).",
        )

    # -- several nodes' answers ---------------------------------------------------------------------
    def _merge(self, args: argparse.Namespace) -> int:
        """``--merge FILE...``: the no-sidecar path over many nodes (each node ran
        ``dynprof stacks --job J --json > stacks.$(hostname).json``)."""
        from collectors import stacks as st

        node_options = args.hosts is not None or args.hostfile or args.slurm is not None or args.discover
        if args.pid or args.job or args.all or args.core or node_options:
            raise errors.UsageError(
                "--merge reads files: it does not go with --pid, --job, --all, --core or the node options"
            )
        t0 = time.monotonic()
        results: list[Any] = []
        hosts: list[str | None] = []
        failures: dict[str, str] = {}
        for path in dict.fromkeys(args.merge):
            try:
                results.append(read_stacks_json(path))
            except errors.DynprofError as exc:
                failures[f"file {path}"] = exc.message
                continue
            hosts.append(host_from_file_name(path))
        if not results:
            raise errors.DynprofError(
                f"no stacks to merge: none of the {len(args.merge)} file(s) could be read",
                help="Each file must be the output of `dynprof stacks --json` (one per node).",
            )
        try:
            processes, failed, groups = st.merge_stack_processes(results, hosts)
        except ValueError as exc:
            raise errors.DynprofError(f"cannot merge: {exc}") from None
        failures.update(failed)
        if not processes:
            raise errors.DynprofError(
                f"no process in the {len(results)} file(s) read", help="See the failures each node reported."
            )
        artifact = None if args.no_save else self._save_merged(args, processes, failures)
        elapsed = time.monotonic() - t0
        if args.json:
            merged = st.merged_result(processes, failures, groups)
            print_json({"artifact": str(artifact.path) if artifact else None, "elapsed_s": round(elapsed, 3), **merged})
        else:
            print(printable_lines(st.render_merged(processes, groups)), end="")
            for who, why in failures.items():
                print(printable_lines(f"FAILED {who}: {why}"))
            hosts_seen = len({p.host for p in processes})
            print(
                f"\n{len(processes)} process(es) of {hosts_seen} node(s) merged from {len(results)} file(s)"
                + (f"; artifact {artifact.path}" if artifact else "")
            )
        return 1 if failures else 0

    def _save_merged(self, args: argparse.Namespace, processes: list[Any], failures: dict[str, str]) -> Any:
        from collectors.stacks import KIND, write_request_artifact
        from dynprof.store import ArtifactStore

        jobs = {p.job for p in processes if p.job}
        options = {"merged_files": [os.path.basename(f) for f in args.merge][:1000]}
        writer = ArtifactStore().create(KIND, job=jobs.pop() if len(jobs) == 1 else None, options=options)
        summary = write_request_artifact(writer, processes, failures)
        return writer.finish("partial" if failures else "complete", summary=summary)

    # -- core files ------------------------------------------------------------------------------
    def _core(self, args: argparse.Namespace) -> Any:
        import os
        import stat

        from collectors import stacks as st

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
            return st.capture_core(
                args.core, args.executable, native=args.native, locals=args.locals, timeout=max(args.timeout, 120.0)
            )
        except st.CaptureError as exc:
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


MAX_JSON_FRAMES = 512


def _main_thread_json(p: Any) -> dict[str, Any] | None:
    """The main thread's stack (innermost first, without locals): what a merged view over
    many nodes groups by (``stacks --hosts``)."""
    from dataclasses import asdict

    main = p.main_thread()
    if main is None:
        return None
    return {
        "tid": main.tid,
        "name": main.name,
        "holds_gil": main.holds_gil,
        "frames": [{**asdict(f), "locals": None} for f in main.frames[:MAX_JSON_FRAMES]],
    }


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"
