"""End a running trace; the artifact is written and its path printed.

The processes stop at their next step boundary (or at once on the main thread when they have
no optimizer steps), then export the trace in the background.
"""

from __future__ import annotations

import argparse

from dynprof.cli._common import (
    Progress,
    add_attach_flag,
    add_targets,
    printable,
    request_then_attach,
    seconds,
    targets_from_args,
)
from dynprof.cli.job import JobCommand
from dynprof.job import stop
from dynprof.node_requests import STOP_TIMEOUT_S, StopRequest
from dynprof.result import Result


class StopCommand(JobCommand):
    """End a running trace; the artifact is written and its path printed."""

    name = "stop"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser)
        add_attach_flag(parser)
        parser.add_argument("--no-wait", action="store_true", help="do not wait for the artifact")
        parser.add_argument("--timeout", type=seconds, default=STOP_TIMEOUT_S, help="seconds to wait for the artifacts")

    def collect_local(self, args: argparse.Namespace) -> Result:
        request = request_then_attach(args, request_from_args)
        return stop.collect(request, Progress(enabled=not getattr(args, "json", False)))

    def render(self, result: Result) -> str:
        if not isinstance(result, stop.Stopped):
            return super().render(result)  # the job-wide answer, rank by rank
        if result.none_stopping:
            # Each error names its process already ("pid N: ...", "process N has no ...").
            return "\n".join(printable(str(res["error"])) for res in result.results)
        lines = []
        for res in result.results:
            who = f"rank {res['rank']} (pid {res['pid']})" if res["rank"] is not None else f"pid {res['pid']}"
            lines.append(printable(f"{who}: {res['status']}: {res['artifact'] or res['error'] or ''}".rstrip(": ")))
        return "\n".join(lines)


def request_from_args(args: argparse.Namespace) -> StopRequest:
    """The options of `dynprof stop` on this node as its request."""
    return StopRequest(**targets_from_args(args), no_wait=args.no_wait, timeout=args.timeout)
