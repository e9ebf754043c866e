"""`dynprof run --checkpoint BUDGET|auto`: the memory plan applied to the job while it trains.

Sets ``DYNPROF_CHECKPOINT``, which the agent reads (dynprof/agent/_mem_apply.py); a job
started by its own launcher asks the same with that variable in its environment.
"""

from __future__ import annotations

import argparse

from dynprof import errors
from dynprof.cli._run_options import RUN_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory plan, applied")
    group.add_argument(
        "--checkpoint",
        metavar="SIZE|P%|auto",
        help="measure an early step (the 4th), plan, and recompute the chosen blocks in backward "
        "(non-reentrant torch.utils.checkpoint) so the step's peak fits SIZE (40G), P%% of the measured "
        "peak, or auto (90%% of the GPU's memory or of the process's cap); the next step's real peak and "
        "time are checked against the plan, more blocks are added when it is over, and a budget "
        "recomputation cannot reach is said and leaves the job as it was. `dynprof ps --json` shows it; "
        "`dynprof memory plan --pid PID --undo` takes it back",
    )


def apply(args: argparse.Namespace, env: dict[str, str]) -> None:
    spec = getattr(args, "checkpoint", None)
    if spec is None:
        return
    from collectors.memory.plan.apply import ENV, parse_spec

    try:
        env[ENV] = parse_spec(spec)
    except ValueError as exc:
        raise errors.UsageError(
            f"--checkpoint {spec[:80]!r}: {exc}", help="Write a size (40G), a percentage (60%) or auto."
        ) from None


RUN_OPTIONS.append((add_arguments, apply))
