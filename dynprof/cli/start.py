"""Start a torch.profiler trace in running processes.

    dynprof start --pid 4242 --steps 5          # the next 5 optimizer steps
    dynprof start --job JOB --steps 3           # every rank, all starting at the same step
    dynprof start --pid 4242 --duration 2       # 2 seconds (processes without optimizer steps)
    dynprof start --pid 4242                    # until `dynprof stop` (or the hard cap)

Step mode starts at the next step boundary (or once step K has completed, with --at-step K)
and captures exactly N steps; several processes named in one command start at the same step.
With a bound (--steps or --duration) the command waits, showing progress, and prints each
artifact's path; with --no-wait it returns once the request is accepted. Without a bound it
returns once the trace is active.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from collectors.torch_trace import SWITCHES
from collectors.torch_trace.collect import Started, TraceRequest
from dynprof.cli._common import (
    MAX_SECONDS,
    MAX_STEP_NUMBER,
    MAX_TRACE_STEPS,
    Progress,
    add_attach_flag,
    add_targets,
    bounded_int,
    printable,
    request_then_attach,
    seconds,
    targets_from_args,
)
from dynprof.cli.job import JobCommand, Text, render_per_rank, who
from dynprof.job import start
from dynprof.job.merge import JobResult
from dynprof.result import Result

_SAMPLE_GROUP = re.compile(r"sample-[0-9a-f]{12}")


def _sample_groups(text: str) -> list[str]:
    groups = [g.strip() for g in text.split(",") if g.strip()]
    if len(groups) > 64 or not all(_SAMPLE_GROUP.fullmatch(g) for g in groups):
        raise argparse.ArgumentTypeError("at most 64 sample groups, each sample- and 12 hex digits")
    return groups


def _activities(text: str) -> list[str]:
    names = [a.strip().lower() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in ("cpu", "cuda", "xpu")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown activity {bad[0]!r} (choose from cpu, cuda, xpu)")
    return names


class StartCommand(JobCommand):
    """Start a torch.profiler trace in running processes."""

    name = "start"
    takes_fetch = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser)
        add_attach_flag(parser)
        bound = parser.add_mutually_exclusive_group()
        bound.add_argument(
            "--steps",
            type=bounded_int(1, MAX_TRACE_STEPS),
            metavar="N",
            help=f"trace exactly N optimizer steps (1..{MAX_TRACE_STEPS:,})",
        )
        bound.add_argument(
            "--duration",
            type=seconds,
            metavar="SEC",
            help=f"trace for SEC seconds (for processes without optimizer steps; at most {MAX_SECONDS:g})",
        )
        parser.add_argument(
            "--at-step",
            type=bounded_int(1, MAX_STEP_NUMBER),
            metavar="K",
            help="start once step K has completed (step mode; default: the next boundary)",
        )
        parser.add_argument("--record-shapes", action="store_true", help="record operator input shapes")
        parser.add_argument("--with-stack", action="store_true", help="record Python stacks of operators")
        parser.add_argument("--profile-memory", action="store_true", help="record tensor allocations")
        parser.add_argument("--with-flops", action="store_true", help="estimate FLOPs of matmul/conv")
        parser.add_argument("--with-modules", action="store_true", help="record nn.Module hierarchy")
        parser.add_argument(
            "--activities",
            type=_activities,
            default=[],
            metavar="cpu,cuda",
            help="what to record (default: cpu, plus cuda when the process uses CUDA)",
        )
        parser.add_argument(
            "--max-duration",
            type=seconds,
            metavar="SEC",
            help=f"hard cap: the agent ends the trace by itself after this long (default 600, at most {MAX_SECONDS:g})",
        )
        parser.add_argument("--no-wait", action="store_true", help="return once the request is accepted")
        parser.add_argument(
            "--sample-keep",
            type=bounded_int(1, 64),
            metavar="N",
            help="this trace is a watch's straggler sample: its group is named sample-..., and this job's older "
            "sample traces in this node's store are deleted but the newest N-1 samples and --keep-groups "
            "(nothing else is ever deleted)",
        )
        parser.add_argument(
            "--keep-groups",
            type=_sample_groups,
            default=[],
            metavar="G,G",
            help="with --sample-keep: sample groups to keep whatever their age (those that named a straggler)",
        )
        parser.add_argument(
            "--timeout",
            type=seconds,
            metavar="SEC",
            help="give up waiting after SEC seconds (the trace goes on and ends by itself)",
        )

    def collect_local(self, args: argparse.Namespace) -> Result:
        request = request_then_attach(args, request_from_args)
        return start.collect(request, Progress(enabled=not getattr(args, "json", False)))

    def render(self, result: Result) -> str:
        if not isinstance(result, Started):  # the job-wide answer
            context = result.context if isinstance(result, JobResult) else {}
            if context.get("as_is"):
                return render_per_rank(result, _as_is_line)
            return _render_nodes(result.to_json(), context["steps"])
        lines = [result.requested] if result.requested else []
        if result.active is not None:
            lines.append(result.active)
        for res in result.results or []:
            who = f"rank {res['rank']} (pid {res['pid']})" if res["rank"] is not None else f"pid {res['pid']}"
            if res.get("note"):  # the trace is still being written (collect.WRITING)
                lines.append(printable(f"{who}: {res['note']}"))
            elif res["artifact"]:
                lines.append(printable(f"{who}: {res['status']}: {res['artifact']}"))
            else:
                lines.append(printable(f"{who}: failed: {res['error']}"))
        return "\n".join(lines)


def _as_is_line(r: dict[str, Any]) -> str:
    return f"{r.get('status', 'tracing')}: {r.get('artifact') or r.get('error') or r.get('state') or ''}"


def _render_nodes(doc: dict[str, Any], steps: int) -> str:
    text = Text()
    at_step = doc["at_step"]
    where = f"step {at_step}" if at_step else "each node's next step boundary"
    results = doc["results"]
    text.print(
        f"trace of {steps} steps on {len(results)} rank(s) of {len(doc['nodes'])} node(s), starting after {where}"
    )
    for r in results:
        detail = r.get("artifact") or r.get("note") or r.get("error") or ""
        text.print(printable(f"{who(r)} on {r['node']}: from step {r.get('start_step')}: {r.get('status')}: {detail}"))
    for m in doc["missed"]:
        rank = f"rank {m['rank']}" if m.get("rank") is not None else "ranks"
        text.print(printable(f"MISSED {rank} on {m['node']}: {m['reason']}"))
    text.artifacts([], doc.get("fetched"))
    text.footer(doc)
    return text.value()


def request_from_args(args: argparse.Namespace) -> TraceRequest:
    """The options of `dynprof start` on this node as the trace kind's request."""
    return TraceRequest(
        **targets_from_args(args),
        steps=args.steps or 0,
        duration=args.duration or 0.0,
        at_step=args.at_step or 0,
        **{key: getattr(args, key) for key in SWITCHES},
        activities=tuple(args.activities),
        max_duration=args.max_duration or 0.0,
        no_wait=args.no_wait,
        timeout=args.timeout,
        sample_keep=args.sample_keep or 0,
        keep_groups=tuple(args.keep_groups),
    )
