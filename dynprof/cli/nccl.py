"""Collect every rank's NCCL flight-recorder dump and say who is missing from which collective.

    dynprof nccl --job JOB          # every rank of the job on this node
    dynprof nccl --pid 4242,4243

The job must run with the recorder on (`dynprof run --flight-recorder -- ...`). Each rank's
agent asks torch for its dump; a rank whose agent cannot answer (its main thread holds the
GIL, or it has no agent) is asked through torch's own dump pipe, which needs no Python.
One artifact holds every rank's dump and the analysis: per process group, the last collective
sequence number each rank enqueued, started and completed; the collective the furthest ranks
wait in; and the ranks that never enqueued it.

A rank's dump is read up to 64 MiB; a larger one is that rank's failure, named with its size.
Over many nodes (--hosts), at most 2 GiB of dumps are read back in all.
"""

from __future__ import annotations

import argparse

from collectors import flight_recorder as fr
from collectors.flight_recorder import collect as kind
from collectors.flight_recorder.collect import NcclRequest
from dynprof.cli._common import (
    add_attach_flag,
    add_targets,
    parse_pids,
    printable_lines,
    request_then_attach,
    seconds,
    targets_from_args,
)
from dynprof.cli.job import JobCommand, Text, answered_count
from dynprof.job.merge import JobResult
from dynprof.result import Result


class NcclCommand(JobCommand):
    """Collect every rank's NCCL flight-recorder dump and say who is missing from which collective."""

    name = "nccl"
    takes_fetch = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser)
        add_attach_flag(parser)
        parser.add_argument("--only-active", action="store_true", help="only collectives not yet completed")
        parser.add_argument(
            "--no-stack-traces", action="store_true", help="leave out the Python stacks of each collective's caller"
        )
        parser.add_argument(
            "--timeout", type=seconds, default=15.0, metavar="SEC", help="per-rank limit for a dump (default 15)"
        )
        parser.add_argument(
            "--skip-pid",
            type=parse_pids,
            metavar="PID[,PID...]",
            help="with --job or --all: leave these processes out (a rank whose agent does not answer would "
            "hold the read for --timeout)",
        )

    def collect_local(self, args: argparse.Namespace) -> Result:
        request = request_then_attach(args, request_from_args)
        got = kind.collect(request)
        return JobResult(got.to_json(), got.exit_code, context={"ranks": len(got.ranks), "elapsed_s": got.elapsed_s})

    def render(self, result: Result) -> str:
        doc = result.to_json()
        context = result.context if isinstance(result, JobResult) else {}
        text = Text()
        if "nodes" not in doc:
            text.print(printable_lines(fr.render_analysis(doc["analysis"])), end="")
            for n in doc["notes"]:
                text.print(f"note: {n}")
            text.print(f"{context['ranks']} rank(s) dumped in {context['elapsed_s']:.2f} s; artifact {doc['artifact']}")
            return text.value()
        if doc["analysis"] is not None:
            text.print(printable_lines(fr.render_analysis(doc["analysis"])), end="")
        for n in doc["notes"]:
            text.print(printable_lines(f"note: {n}"))
        text.artifacts(doc["artifacts"], doc.get("fetched"))
        text.print(f"{len(doc['ranks'])} rank(s) dumped on {answered_count(doc)} of {len(doc['nodes'])} node(s)")
        text.footer(doc)
        return text.value()


def request_from_args(args: argparse.Namespace) -> NcclRequest:
    """The options of `dynprof nccl` as the kind's request."""
    return NcclRequest(
        **targets_from_args(args),
        only_active=args.only_active,
        stack_traces=not args.no_stack_traces,
        timeout=args.timeout,
        skip=tuple(args.skip_pid or ()),
    )
