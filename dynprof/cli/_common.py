"""Pieces shared by the subcommands: option groups, target selection, output."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from dynprof import errors

# Re-exported for the subcommands: argument types (dynprof.arguments), the agents of this node
# (dynprof.agents), terminal output (dynprof.output) and units.
from dynprof.agents import parallel as parallel
from dynprof.agents import refresh_records as refresh_records
from dynprof.agents import resolve
from dynprof.agents import select_workers as select_workers
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
from dynprof.output import Progress as Progress
from dynprof.output import print_json as print_json
from dynprof.output import printable as printable
from dynprof.output import printable_lines as printable_lines
from dynprof.output import table as table
from dynprof.registry import AgentRecord
from dynprof.units import human_age as human_age
from dynprof.units import human_bytes as human_bytes

R = TypeVar("R")


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


def targets_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The targets of :func:`add_targets`' options as a request's fields (``pids``, ``job``, ``all``)."""
    return {"pids": tuple(args.pid or ()), "job": args.job, "all": bool(args.all)}


def add_attach_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attach",
        action="store_true",
        help="first start the agent in target processes that have none (with --pid or --job; see `dynprof attach`)",
    )


# -- target selection ------------------------------------------------------------------------
def resolve_agents(args: argparse.Namespace) -> list[AgentRecord]:
    """Agent records for --pid / --job / --all (:func:`dynprof.agents.resolve`), with a precise
    error when none match. With ``--attach``, processes named by --pid or found by --job that
    have no agent get one first."""
    if getattr(args, "attach", False):
        attach_first(args)
    return resolve(pids=getattr(args, "pid", None), job=getattr(args, "job", None))


def request_then_attach(args: argparse.Namespace, make: Callable[[argparse.Namespace], R]) -> R:
    """The request ``make`` reads from ``args`` (so a bad option is refused before anything
    starts), once ``--attach`` has started the agent in its targets that have none."""
    request = make(args)
    if args.attach:
        attach_first(args)
    return request


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
