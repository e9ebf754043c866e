"""`dynprof memory`: CUDA memory snapshots and allocator history of running processes."""

from __future__ import annotations

import argparse

from collectors.memory.collect import MemoryPlanRequest, MemoryRequest
from dynprof import errors
from dynprof.cli._common import (
    MAX_HISTORY_EVENTS,
    add_attach_flag,
    add_targets,
    bounded_int,
    human_bytes,
    request_then_attach,
    seconds,
    table,
    targets_from_args,
)
from dynprof.cli._memory_plan import render as render_plan
from dynprof.cli._node_args import nodes_requested
from dynprof.cli.job import JobCommand
from dynprof.job import memory
from dynprof.job.memory import MemoryPlanResults, MemoryResults
from dynprof.result import Result


class MemoryCommand(JobCommand):
    """Take a CUDA memory snapshot of running processes now, or turn allocator history on or off.

    dynprof memory --pid 1234                          snapshot now (same artifact as at an OOM)
    dynprof memory --job JOB --history-start 200000    record the next 200000 allocator events
    dynprof memory --all --history-stop                stop recording history
    dynprof memory plan --pid 1234 --budget 60%        measure the next steps; what to checkpoint
    dynprof memory plan --pid 1234 --undo              take back what `dynprof run --checkpoint` applied

    Each snapshot is one `memory` artifact per process (see `dynprof show`, `dynprof memory-report`).
    Starting history clears what was recorded before, so the next snapshot shows only what happened
    since; --stacks all adds C++ frames, which makes recording and dumping much slower.
    """

    name = "memory"
    takes_fetch = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "what",
            nargs="?",
            choices=("plan",),
            help="plan: time each block's forward over the next 3 steps, measure the step after them "
            "(each block's saved activations) and say which blocks to recompute in backward to fit "
            "--budget or free --save",
        )
        add_targets(parser)
        add_attach_flag(parser)
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--history-start",
            type=bounded_int(1, MAX_HISTORY_EVENTS),
            metavar="N",
            help="start recording the next N allocator events (with stacks) instead of a snapshot",
        )
        action.add_argument("--history-stop", action="store_true", help="stop recording allocator history")
        parser.add_argument(
            "--stacks",
            choices=("python", "all"),
            default="python",
            help="with --history-start: Python frames only (default) or C++ frames too",
        )
        sizes = parser.add_mutually_exclusive_group()
        sizes.add_argument(
            "--budget",
            metavar="SIZE|P%",
            help="with plan: the peak the step must fit in (40G, or a percentage of the measured peak)",
        )
        sizes.add_argument(
            "--save", metavar="SIZE|P%", help="with plan: the bytes to take off the peak (8G, or a percentage)"
        )
        parser.add_argument(
            "--undo",
            action="store_true",
            help="with plan: take back the checkpointing that `dynprof run --checkpoint` applied (at the "
            "job's next step boundary)",
        )
        parser.add_argument(
            "--timeout", type=seconds, default=300.0, help="seconds to wait for each process's snapshot (default 300)"
        )

    def collect(self, args: argparse.Namespace) -> Result:
        if getattr(args, "what", None) == "plan":
            if nodes_requested(args) is not None:
                raise errors.UsageError(
                    "dynprof memory plan asks this node's agents only",
                    help="Run it on the node of the rank to measure (one rank is enough when the ranks are alike).",
                )
        return super().collect(args)

    def collect_local(self, args: argparse.Namespace) -> Result:
        if getattr(args, "what", None) == "plan":
            if args.history_start is not None or args.history_stop:
                raise errors.UsageError("dynprof memory plan takes no --history-start/--history-stop")
            plan_request = request_then_attach(args, plan_request_from_args)
            return memory.collect_plan(plan_request, raise_single=not getattr(args, "json", False))
        if args.budget is not None or args.save is not None or args.undo:
            raise errors.UsageError(
                "--budget, --save and --undo are options of `dynprof memory plan`",
                help="Run dynprof memory plan --pid PID --budget SIZE.",
            )
        if args.history_start is not None and args.history_start <= 0:
            raise errors.UsageError("--history-start N needs N > 0 events", help="Use --history-stop to stop.")
        request = request_then_attach(args, request_from_args)
        return memory.collect(request, raise_single=not getattr(args, "json", False))

    def render(self, result: Result) -> str:
        if isinstance(result, MemoryPlanResults):
            return render_plan(result.to_json())
        if not isinstance(result, MemoryResults):
            return super().render(result)  # the job-wide answer, rank by rank
        results = result.results
        rows = []
        for r in results:
            who = f"rank {r['rank']}" if r["rank"] is not None else "-"
            if r["status"] == "failed":
                rows.append([who, r["pid"], "failed", r["error"]])
            elif result.history:
                rows.append([who, r["pid"], "ok", f"memory history: {r['memory_history']}"])
            else:
                s = r.get("summary") or {}
                detail = (
                    f"{human_bytes(s.get('allocated_bytes') or 0)} allocated / "
                    f"{human_bytes(s.get('reserved_bytes') or 0)} reserved, {s.get('capture_s')} s"
                )
                if s.get("top_site"):
                    detail += f"; top site {s['top_site']} ({human_bytes(s.get('top_site_bytes') or 0)})"
                rows.append([who, r["pid"], r["status"], detail])
                rows.append(["", "", "", r["artifact"]])
        lines = [table(rows, ["rank", "pid", "status", "result"])]
        for r in results:
            if r["status"] not in ("ok", "complete") and r.get("help"):
                lines.append(f"  what to do: {r['help']}")
        return "\n".join(lines)


def request_from_args(args: argparse.Namespace) -> MemoryRequest:
    """The options of `dynprof memory` (a snapshot, or history on or off) as the kind's request."""
    return MemoryRequest(
        **targets_from_args(args),
        history_start=args.history_start,
        history_stop=bool(args.history_stop),
        stacks=args.stacks,
        timeout=args.timeout,
    )


def plan_request_from_args(args: argparse.Namespace) -> MemoryPlanRequest:
    """The options of `dynprof memory plan` as the kind's request."""
    return MemoryPlanRequest(
        **targets_from_args(args),
        budget=args.budget,
        save=args.save,
        timeout=args.timeout,
        undo=bool(args.undo),
    )
