"""`dynprof run` options for the hang watchdog; the agent reads the variables they set."""

from __future__ import annotations

import argparse
import math

from dynprof import errors
from dynprof.cli._common import seconds
from dynprof.cli._run_options import RUN_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("hang watchdog")
    group.add_argument(
        "--hang-timeout",
        type=seconds,
        metavar="SEC",
        help="save every thread's stacks when no optimizer step completes for SEC seconds, and "
        "again 3*SEC later (also DYNPROF_HANG_TIMEOUT; default off)",
    )
    group.add_argument(
        "--hang-first-step-timeout",
        type=seconds,
        metavar="SEC",
        help="also watch the first step (compilation, data loading) with this timeout "
        "(default: the first step is not watched)",
    )


def _check(name: str, value: float) -> str:
    if not math.isfinite(value) or value <= 0:
        raise errors.UsageError(f"{name} must be a positive number of seconds, not {value:g}")
    return repr(float(value))


def apply(args: argparse.Namespace, env: dict[str, str]) -> None:
    timeout = getattr(args, "hang_timeout", None)
    first = getattr(args, "hang_first_step_timeout", None)
    if timeout is not None:
        env["DYNPROF_HANG_TIMEOUT"] = _check("--hang-timeout", timeout)
    if first is not None:
        if timeout is None and not env.get("DYNPROF_HANG_TIMEOUT"):
            raise errors.UsageError("--hang-first-step-timeout needs --hang-timeout")
        env["DYNPROF_HANG_FIRST_STEP_TIMEOUT"] = _check("--hang-first-step-timeout", first)


RUN_OPTIONS.append((add_arguments, apply))
