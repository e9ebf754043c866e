"""`dynprof run` options for memory capture; the agent reads the variables they set."""

from __future__ import annotations

import argparse

from collectors.memory.policy import PolicyError, parse_policy
from dynprof import errors
from dynprof.cli._common import MAX_SECONDS, bounded_int, nonnegative_float
from dynprof.cli._run_options import RUN_OPTIONS
from dynprof.units import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory capture")
    group.add_argument(
        "--memory-history",
        metavar="auto[:B%]|off|N|all-stacks[:N]|state",
        help="CUDA allocator history recorded for snapshots: auto (default) records allocation stacks "
        "only as much as keeps the estimated step-time cost under B %% (0.5 %%), all the time on light "
        "loops, in short windows on launch-bound ones; off; the last N events with Python stacks, all "
        "the time; the same with C++ frames too (slow); or the stacks of live blocks only",
    )
    group.add_argument(
        "--memory-oom-interval",
        type=nonnegative_float(MAX_SECONDS),
        metavar="SECONDS",
        help="at most one CUDA OOM capture per this many seconds in a process (default 60)",
    )
    group.add_argument(
        "--memory-oom-max",
        type=bounded_int(0, 1_000_000),
        metavar="N",
        help="at most N CUDA OOM captures per process (default 3; 0 turns OOM capture off)",
    )
    group.add_argument(
        "--host-memory-fraction",
        metavar="F|off",
        help="capture host-memory state once a process's memory passes this fraction of its "
        "cgroup limit (or of the machine's memory) (default 0.9)",
    )
    group.add_argument(
        "--host-memory-limit",
        metavar="SIZE",
        help="weigh host memory against this limit instead of the cgroup's (e.g. 48G)",
    )


def apply(args: argparse.Namespace, env: dict[str, str]) -> None:
    if getattr(args, "memory_history", None) is not None:
        try:
            policy = parse_policy(args.memory_history)
        except PolicyError as exc:
            raise errors.UsageError(
                f"--memory-history: {exc}",
                help="Give a number of events (100000), off, all-stacks, all-stacks:N or state.",
            ) from None
        env["DYNPROF_MEMORY_HISTORY"] = policy.describe()
    if getattr(args, "memory_oom_interval", None) is not None:
        if args.memory_oom_interval < 0:
            raise errors.UsageError("--memory-oom-interval must be >= 0")
        env["DYNPROF_MEMORY_OOM_INTERVAL_S"] = repr(float(args.memory_oom_interval))
    if getattr(args, "memory_oom_max", None) is not None:
        if args.memory_oom_max < 0:
            raise errors.UsageError("--memory-oom-max must be >= 0")
        env["DYNPROF_MEMORY_OOM_MAX"] = str(int(args.memory_oom_max))
    fraction = getattr(args, "host_memory_fraction", None)
    if fraction is not None:
        if fraction.strip().lower() in ("off", "0"):
            env["DYNPROF_HOST_MEMORY_FRACTION"] = "off"
        else:
            try:
                value = float(fraction)
            except ValueError:
                value = -1.0
            if not 0 < value <= 1:
                raise errors.UsageError(f"--host-memory-fraction {fraction!r} is not a number in (0, 1] or off")
            env["DYNPROF_HOST_MEMORY_FRACTION"] = repr(value)
    limit = getattr(args, "host_memory_limit", None)
    if limit is not None:
        try:
            env["DYNPROF_HOST_MEMORY_LIMIT"] = str(parse_size(limit))
        except errors.DynprofError as exc:
            raise errors.UsageError(f"--host-memory-limit: {exc.message}", help=exc.help) from None


RUN_OPTIONS.append((add_arguments, apply))
