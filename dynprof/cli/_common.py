"""Pieces shared by the subcommands: option groups, target selection, output."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence

from dynprof import errors, roles

# Re-exported for the subcommands: argument types (dynprof.arguments), the agents of this node
# (dynprof.agents), terminal output (dynprof.output) and units.
from dynprof.agents import parallel as parallel
from dynprof.agents import refresh_records as refresh_records
from dynprof.arguments import MAX_HISTORY_EVENTS as MAX_HISTORY_EVENTS
from dynprof.arguments import MAX_PATH_BYTES as MAX_PATH_BYTES
from dynprof.arguments import MAX_PID as MAX_PID
from dynprof.arguments import MAX_SECONDS as MAX_SECONDS
from dynprof.arguments import MAX_STEP_NUMBER as MAX_STEP_NUMBER
from dynprof.arguments import MAX_TRACE_STEPS as MAX_TRACE_STEPS
from dynprof.arguments import bounded_int as bounded_int
from dynprof.arguments import host_arg as host_arg
from dynprof.arguments import nonnegative_float as nonnegative_float
from dynprof.arguments import parse_float as parse_float
from dynprof.arguments import parse_int as parse_int
from dynprof.arguments import parse_pid as parse_pid
from dynprof.arguments import parse_pids as parse_pids
from dynprof.arguments import path_arg as path_arg
from dynprof.arguments import port as port
from dynprof.arguments import positive_float as positive_float
from dynprof.arguments import seconds as seconds
from dynprof.output import print_json as print_json
from dynprof.output import printable as printable
from dynprof.output import printable_lines as printable_lines
from dynprof.output import table as table
from dynprof.registry import AgentRecord, list_records, read_record
from dynprof.safetext import one_line
from dynprof.units import human_age as human_age
from dynprof.units import human_bytes as human_bytes


# -- option groups -----------------------------------------------------------------------------
def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def add_targets(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--pid", type=parse_pids, metavar="PID[,PID...]", help="target process ids")
    group.add_argument(
        "--job",
        metavar="JOB",
        help="the trainers of this job on this node: every rank, no launcher (ROLE in `dynprof ps`)",
    )
    group.add_argument("--all", action="store_true", help="every agent on this node")


def add_attach_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attach",
        action="store_true",
        help="first start the agent in target processes that have none (with --pid or --job; see `dynprof attach`)",
    )


# -- target selection ------------------------------------------------------------------------
def select_workers(records: Sequence[AgentRecord]) -> list[AgentRecord]:
    """The training processes among ``records``, job by job (see ``dynprof.roles``): the
    trainers, or where none is known to train yet, the processes that are neither launchers
    (torchrun, accelerate launch, a Python wrapper of the script) nor DataLoader workers."""
    by_job: dict[str | None, list[AgentRecord]] = {}
    for r in records:
        by_job.setdefault(r.job_id, []).append(r)
    kept: list[AgentRecord] = []
    for group in by_job.values():
        kept.extend(roles.targets(group))
    kept.sort(key=lambda r: (r.job_id or "", r.rank if r.rank is not None else -1, r.pid))
    return kept


def resolve_agents(args: argparse.Namespace) -> list[AgentRecord]:
    """Agent records for --pid / --job / --all, with a precise error when none match.

    With ``--attach``, processes named by --pid or found by --job that have no agent get one first.
    """
    if getattr(args, "attach", False):
        attach_first(args)
    if getattr(args, "pid", None):
        records = []
        for pid in args.pid:
            errors.probe_pid(pid)
            record = read_record(pid)
            if record is None or not record.is_alive():
                raise errors.NoAgent(
                    f"process {pid} has no dynprof agent{_describe_pid(pid)}",
                    help=f"Attach one: `dynprof attach {pid}`, or add --attach to this command; or "
                    + errors.LAUNCH_WITH_AGENT_HELP,
                )
            records.append(record)
        return records
    records = refresh_records(list_records())
    if getattr(args, "job", None):
        matching = [r for r in records if r.job_id == args.job]
        if not matching:
            # Job ids are what the jobs' environments said: each shown as one printable line.
            jobs = sorted({one_line(r.job_id or "-", 200) for r in records})
            raise errors.DynprofError(
                f"no agent of job {args.job!r} on this node",
                help=(
                    f"Attach agents to its processes: `dynprof attach --job {one_line(args.job, 200)}`, or add "
                    "--attach to this command. " + (("Jobs with agents here: " + ", ".join(jobs)) if jobs else "")
                ).strip(),
            )
        chosen = select_workers(matching)
        _note_left_out(args.job, matching, chosen)
        return chosen
    if not records:
        raise errors.NoAgent("no dynprof agent is running on this node (for this user)")
    return select_workers(records)


_ROLE_NOTES = {
    roles.LAUNCHER: "a launcher",
    roles.WORKER: "a DataLoader worker",
    roles.OTHER: "no optimizer step yet",
    roles.TRAINER: "a trainer",
}


# What _note_left_out has said in this process: a long-lived one (a sidecar hosting a watch,
# which reads the job's stacks and flight recorder at every look) says each once.
_SAID_LEFT_OUT: set[tuple[str, tuple[tuple[int, str], ...]]] = set()
_SAID_LEFT_OUT_LOCK = threading.Lock()
_MAX_SAID_LEFT_OUT = 1024


def _note_left_out(job: str, matching: Sequence[AgentRecord], chosen: Sequence[AgentRecord]) -> None:
    """Say which processes of the job --job does not target, and why (their role): once per
    process for the same processes in the same roles (a watch's every look selects again)."""
    kept = {r.pid for r in chosen}
    left = [r for r in matching if r.pid not in kept]
    if not left:
        return
    role_of = roles.job_roles(matching)
    key = (job, tuple(sorted((r.pid, role_of[r.pid]) for r in left)))
    with _SAID_LEFT_OUT_LOCK:
        if key in _SAID_LEFT_OUT:
            return
        if len(_SAID_LEFT_OUT) >= _MAX_SAID_LEFT_OUT:
            _SAID_LEFT_OUT.clear()
        _SAID_LEFT_OUT.add(key)
    print(
        f"dynprof: job {printable(job)}: not targeting {len(left)} process(es) that are not trainers: "
        + ", ".join(f"pid {r.pid} ({_ROLE_NOTES[role_of[r.pid]]})" for r in left),
        file=sys.stderr,
    )


def attach_first(args: argparse.Namespace) -> None:
    """``--attach``: start the agent in the targets that have none (a no-op for the others)."""
    from dynprof.attach import AttachOptions, attach, existing_agent, find_job_processes

    if getattr(args, "all", False):
        raise errors.UsageError("--attach needs --pid or --job", help="--all selects processes that have agents.")
    if getattr(args, "pid", None):
        todo, settings = list(args.pid), {}
    elif getattr(args, "job", None):
        search = find_job_processes(args.job)
        todo, settings = [p.pid for p in search.found], {"DYNPROF_JOB_ID": args.job}
    else:
        return
    for pid in todo:
        errors.probe_pid(pid)
        if existing_agent(pid) is not None:
            continue
        result = attach(pid, AttachOptions(settings=dict(settings)))
        print(f"dynprof: {result.describe()}", file=sys.stderr)


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        return ""
    return f" ({comm})"


# -- output -------------------------------------------------------------------------------------
class Progress:
    """A one-line progress display on stderr (rewritten in place on a terminal)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = ""
        self._last_print = 0.0

    def update(self, text: str) -> None:
        if not self.enabled or text == self._last:
            return
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif now - self._last_print >= 1.0:
            sys.stderr.write(text + "\n")
            self._last_print = now
        self._last = text

    def done(self) -> None:
        if self.enabled and self.tty and self._last:
            sys.stderr.write("\n")
        self._last = ""
