"""`dynprof attach`: start the agent in running Python processes (transport: dynprof.attach)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dynprof import errors
from dynprof.attach import METHODS, AttachOptions, AttachResult, attach, find_job_processes
from dynprof.cli._common import MAX_SECONDS, add_json, parse_pid, positive_float, printable
from dynprof.cli._run_options import RUN_OPTIONS, RunOption, load_run_options
from dynprof.result import Result, error_json

# `dynprof run` options that also apply to a running process (the flight recorder does not:
# NCCL reads its settings when the process group is created).
ATTACH_RUN_OPTIONS = ("dynprof.cli._run_memory", "dynprof.cli._run_hang")


def _run_options() -> list[RunOption]:
    load_run_options()
    wanted = {name for name in ATTACH_RUN_OPTIONS}
    return [opt for opt in RUN_OPTIONS if opt[0].__module__ in wanted]


def add_attach_options(parser: argparse.ArgumentParser) -> None:
    """The options of `dynprof attach` that shape how and with what settings the agent starts."""
    group = parser.add_argument_group("attach")
    group.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="how to get in: sys.remote_exec (Python 3.14+ targets, same Python here), gdb, or the best "
        "available (default auto)",
    )
    group.add_argument(
        "--wait",
        type=positive_float(MAX_SECONDS),
        default=2.0,
        metavar="SEC",
        help="seconds to wait for the target's main thread to reach the interpreter before running the "
        "bootstrap under PyGILState_Ensure (default 2)",
    )
    group.add_argument(
        "--ready-timeout",
        type=positive_float(MAX_SECONDS),
        default=30.0,
        metavar="SEC",
        help="seconds to wait for the agent to be ready once it runs (default 30)",
    )


def attach_settings(args: argparse.Namespace) -> dict[str, str]:
    """The agent settings (DYNPROF_* names) the run options in ``args`` ask for."""
    settings: dict[str, str] = {}
    for _, apply in _run_options():
        apply(args, settings)
    return settings


def attach_options(args: argparse.Namespace, settings: dict[str, str]) -> AttachOptions:
    if args.wait <= 0 or args.ready_timeout <= 0:
        raise errors.UsageError("--wait and --ready-timeout take a positive number of seconds")
    return AttachOptions(
        method=args.method,
        settings=settings,
        main_thread_wait_s=args.wait,
        ready_timeout_s=args.ready_timeout,
    )


def attach_many(pids: list[int], options: AttachOptions) -> list[AttachResult | errors.DynprofError]:
    """Attach to each pid in turn; each answer is a result or the error it met."""
    out: list[AttachResult | errors.DynprofError] = []
    for pid in pids:
        try:
            result: AttachResult | errors.DynprofError = attach(pid, options)
        except errors.DynprofError as exc:
            result = exc
        out.append(result)
    return out


def said(pid: int, result: AttachResult | errors.DynprofError, many: bool) -> str | None:
    """What a person is told of one pid (with several, or a job's, an error too: it does not end
    the command)."""
    if isinstance(result, AttachResult):
        return result.describe()
    if not many:
        return None
    return f"pid {pid}: error: {result.message}" + (f"\n  what to do: {result.help}" if result.help else "")


class AttachCommand:
    """Start the dynprof agent in running Python processes launched without it.

    dynprof attach PID [PID...]
    dynprof attach --job JOB      every process of a job on this node, found by the
                                  TORCHELASTIC_RUN_ID, SLURM_JOB_ID or DYNPROF_JOB_ID
                                  in its environment

    Then use the process as if it had been started under `dynprof run` (`dynprof start
    --pid PID --steps 3`, `dynprof memory --pid PID`), or add --attach to those commands.
    Attaching to a process that already has an agent does nothing and says so.

    Needs ptrace permission on the target, as py-spy and gdb do: the same user, and Yama
    kernel.yama.ptrace_scope 0 (or CAP_SYS_PTRACE; in Kubernetes `securityContext:
    {capabilities: {add: [SYS_PTRACE]}}`). Python < 3.14 targets need gdb on PATH. The target
    stops for a fraction of a second while gdb queues the request; the agent then starts on a
    thread of its own. Attached processes count optimizer steps from the attach; `dynprof
    start --job` aligns them by the time of their step boundaries. See docs/attach.md.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("pids", nargs="*", type=parse_pid, metavar="PID", help="process ids to attach to")
        parser.add_argument(
            "--job",
            metavar="JOB",
            help="every process of this job on this node, found by TORCHELASTIC_RUN_ID, SLURM_JOB_ID or "
            "DYNPROF_JOB_ID in its environment",
        )
        add_attach_options(parser)
        for add, _ in _run_options():
            add(parser)
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        if bool(args.pids) == bool(args.job):
            raise errors.UsageError("give either PIDs or --job JOB", help="dynprof attach 4242, dynprof attach --job J")
        for pid in args.pids:
            if pid <= 0:
                raise errors.UsageError(f"invalid pid {pid}: a pid is a positive integer")
        settings = attach_settings(args)
        report: dict[str, Any] = {}
        messages: list[str] = []
        if args.job:
            search = find_job_processes(args.job)
            report["job"] = args.job
            report["found"] = [p.pid for p in search.found]
            report["skipped"] = [{"pid": p.pid, "why": why} for p, why in search.skipped]
            if not search.found:
                raise errors.ProcessNotFound(
                    f"no Python process of job {args.job!r} found on this node (for this user)",
                    help="The job's processes are found by TORCHELASTIC_RUN_ID, SLURM_JOB_ID or DYNPROF_JOB_ID "
                    "in their environment; give the pids instead: dynprof attach PID...",
                )
            # Command lines and environments are the processes' own: shown escaped.
            messages.append(
                printable(
                    f"job {args.job}: found {len(search.found)} process(es): "
                    + "; ".join(p.describe() for p in search.found)
                )
            )
            messages += [printable(f"job {args.job}: skipped pid {p.pid}: {why}") for p, why in search.skipped]
            settings.setdefault("DYNPROF_JOB_ID", args.job)
            pids = [p.pid for p in search.found]
        else:
            pids = list(dict.fromkeys(args.pids))
        options = attach_options(args, settings)
        if len(pids) == 1 and not args.job:
            results: list[AttachResult | errors.DynprofError] = [attach(pids[0], options)]
        else:
            results = attach_many(pids, options)
        gone = {pid for pid, r in zip(pids, results) if args.job and _exited(pid, r)}
        if not args.json:
            # The log and socket paths come from the target's bootstrap: shown escaped (by emit).
            # A job's process that fails does not end the command (even its only one): its error is said here.
            many = len(pids) > 1 or bool(args.job)
            messages += [m for pid, r in zip(pids, results) if (m := said(pid, r, many)) is not None]
            messages += [f"job {args.job}: pid {pid} exited meanwhile (gone, not a failure)" for pid in sorted(gone)]
        failures = [r for pid, r in zip(pids, results) if isinstance(r, errors.DynprofError) and pid not in gone]
        report["processes"] = [
            r.to_dict()
            if isinstance(r, AttachResult)
            else {"pid": pid, "status": "gone"}
            if pid in gone
            else {"pid": pid, "status": "failed", "error": error_json(r)}
            for pid, r in zip(pids, results)
        ]
        return Result(report, failures[0].exit_code if failures else 0, messages)

    def render(self, result: Result) -> str:
        return ""  # what happened is said on stderr; --json prints the report


def _exited(pid: int, result: object) -> bool:
    """With --job, a process that exited while it was attached to (a short-lived process of
    the job) is gone, not a failure."""
    if not isinstance(result, errors.DynprofError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie, not yet reaped by its parent, has exited too
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rfind(b")") + 2 :].startswith(b"Z")
    except OSError:
        return True
