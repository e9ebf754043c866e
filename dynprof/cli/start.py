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
import math
import sys
import time
import uuid
from typing import Any

from dynprof import errors
from dynprof.cli._common import (
    MAX_SECONDS,
    MAX_STEP_NUMBER,
    MAX_TRACE_STEPS,
    Progress,
    add_attach_flag,
    add_json,
    add_targets,
    bounded_int,
    parallel,
    print_json,
    printable,
    resolve_agents,
    seconds,
)
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.client import AgentClient
from dynprof.proto import pb
from dynprof.registry import AgentRecord

# Multi-process step alignment: start this far in the future, in seconds of training.
ALIGN_LEAD_S = 0.3
ALIGN_RETRIES = 3
POLL_S = 0.1


def _activities(text: str) -> list[str]:
    names = [a.strip().lower() for a in text.split(",") if a.strip()]
    bad = [a for a in names if a not in ("cpu", "cuda", "xpu")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown activity {bad[0]!r} (choose from cpu, cuda, xpu)")
    return names


def alignment_step(statuses: list[Any], lead_s: float = ALIGN_LEAD_S) -> int:
    """A step every process reaches after the request arrives: the furthest one's step,
    plus enough steps to cover ``lead_s`` of training at the fastest process's pace."""
    current = max(s.step for s in statuses)
    times = [s.step_time_s for s in statuses if s.step_time_s > 0]
    margin = 2 if not times else max(2, min(10_000, math.ceil(lead_s / min(times)) + 1))
    return int(current + margin)


def boundary_offsets(statuses: list[Any]) -> list[int] | None:
    """Per process, its step counter minus the first process's, at the same step boundary.

    Ranks of a synchronous job cross each step boundary at nearly the same moment, but an
    attached process counts steps from the attach, so counters of ranks attached at different
    moments disagree. The time of each one's latest boundary says how many boundaries apart
    their counters were read. None when step times are unknown.
    """
    times = [s.step_time_s for s in statuses if s.step_time_s > 0]
    if not times or any(s.last_step_at <= 0 for s in statuses):
        return None
    period = sorted(times)[len(times) // 2]
    ref = statuses[0]
    return [int(s.step - round((s.last_step_at - ref.last_step_at) / period) - ref.step) for s in statuses]


def aligned_steps(statuses: list[Any], offsets: list[int], lead_s: float = ALIGN_LEAD_S) -> list[int]:
    """``at_step`` for each process so that all start after the same boundary."""
    common = alignment_step([replace_step(s, s.step - o) for s, o in zip(statuses, offsets)], lead_s)
    return [common + o for o in offsets]


def replace_step(status: Any, step: int) -> Any:
    copy = type(status)()
    copy.CopyFrom(status)
    copy.step = max(0, step)
    return copy


class StartCommand:
    """Start a torch.profiler trace in running processes."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
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
            "--timeout",
            type=seconds,
            metavar="SEC",
            help="give up waiting after SEC seconds (the trace goes on and ends by itself)",
        )
        add_json(parser)
        add_many_node_args(parser, fetch=True)

    def run(self, args: argparse.Namespace) -> int:
        nodes = nodes_requested(args)
        if nodes is not None:
            from dynprof.cli import _many_nodes

            return _many_nodes.start(args, nodes)
        if args.at_step is not None and args.duration is not None:
            raise errors.UsageError("--at-step applies to step mode, not to --duration")
        records = resolve_agents(args)
        clients = [AgentClient.for_record(r, timeout=5.0) for r in records]
        statuses = _check(parallel(lambda c: c.status(), clients), records)
        steps = args.steps or 0
        duration = args.duration or 0.0
        if not args.pid and not duration and len(records) > 1:
            # Among the processes of a job, those that never stepped an optimizer (a launcher,
            # data-loader workers started with spawn) would wait for a step that never comes.
            stepping = [s.step > 0 for s in statuses]
            if any(stepping) and not all(stepping):
                skipped = [r.pid for r, ok in zip(records, stepping) if not ok]
                print(
                    f"dynprof: skipping {len(skipped)} process(es) that have not stepped an optimizer "
                    f"(a launcher or data-loader worker?): pid {', '.join(map(str, skipped))}",
                    file=sys.stderr,
                )
                keep = [i for i, ok in enumerate(stepping) if ok]
                records = [records[i] for i in keep]
                clients = [clients[i] for i in keep]
                statuses = [statuses[i] for i in keep]
        align = len(records) > 1 and duration == 0 and all(s.step_hook_installed and s.step > 0 for s in statuses)
        at_step = args.at_step or 0
        group_id = uuid.uuid4().hex[:12]
        options = pb.TraceOptions(
            record_shapes=args.record_shapes,
            with_stack=args.with_stack,
            profile_memory=args.profile_memory,
            with_flops=args.with_flops,
            with_modules=args.with_modules,
            activities=args.activities,
        )
        lead = ALIGN_LEAD_S
        # Attached processes count steps from their attach: align them by boundary times.
        by_time = align and not args.at_step and any(r.activation == "attach" for r in records)
        for attempt in range(ALIGN_RETRIES):
            per_process = [at_step] * len(records)
            if align and not args.at_step:
                offsets = boundary_offsets(statuses) if by_time else None
                if offsets is not None:
                    per_process = aligned_steps(statuses, offsets, lead)
                    at_step = per_process[0]
                else:
                    at_step = alignment_step(statuses, lead)
                    per_process = [at_step] * len(records)
            requests = [
                pb.StartTraceRequest(
                    steps=steps,
                    duration_s=duration,
                    at_step=k,
                    options=options,
                    max_duration_s=args.max_duration or 0.0,
                    group_id=group_id,
                )
                for k in per_process
            ]
            replies = parallel(lambda cr: cr[0].request(start_trace=cr[1]), list(zip(clients, requests)))
            failures = [(r, x) for r, x in zip(records, replies) if isinstance(x, Exception)]
            if not failures:
                break
            _cancel(clients, replies)
            passed = [x for _, x in failures if getattr(x, "code", None) == pb.STEP_PASSED]
            if passed and not args.at_step and attempt + 1 < ALIGN_RETRIES:
                lead *= 4
                statuses = _check(parallel(lambda c: c.status(), clients), records)
                continue
            raise failures[0][1]
        started = {r.pid: reply.trace_started.trace for r, reply in zip(records, replies)}
        where = f"at step {at_step}" if at_step else ("at the next step boundary" if steps else "now")
        if len(set(per_process)) > 1:
            where = (
                "at the same step boundary (by each process's own step count: "
                + ", ".join(f"pid {r.pid} after {k}" for r, k in zip(records, per_process))
                + ")"
            )
        what = f"{steps} steps" if steps else (f"{duration:g} s" if duration else "until `dynprof stop`")
        if not args.json:
            print(
                f"dynprof: trace of {what} requested from {len(records)} process(es), starting {where}"
                f" (group {group_id})"
            )
        if args.no_wait:
            if args.json:
                print_json(
                    {
                        "group_id": group_id,
                        "at_step": at_step,
                        "state": "armed",
                        "targets": [_target(r, started[r.pid].start_step) for r in records],
                    }
                )
            return 0
        if not steps and not duration:
            return self._wait_active(args, clients, records, group_id)
        return self._wait_done(args, clients, records, group_id, steps, at_step)

    def _wait_active(
        self, args: argparse.Namespace, clients: list[AgentClient], records: list[AgentRecord], group_id: str
    ) -> int:
        deadline = time.monotonic() + (args.timeout or 120.0)
        progress = Progress(enabled=not args.json)
        while True:
            states = parallel(lambda c: c.status().trace, clients)
            active = [s for s in states if not isinstance(s, Exception) and s.state == "tracing"]
            failed = [
                (r, s)
                for r, s in zip(records, states)
                if isinstance(s, Exception) or (s.state == "idle" and s.group_id == group_id)
            ]
            if failed:
                progress.done()
                record, s = failed[0]
                raise (
                    s
                    if isinstance(s, Exception)
                    else errors.AgentError(
                        f"pid {record.pid}: the trace did not start: {s.last_error or 'unknown reason'}"
                    )
                )
            if len(active) == len(records):
                progress.done()
                if args.json:
                    print_json(
                        {
                            "group_id": group_id,
                            "state": "tracing",
                            "targets": [_target(r, s.start_step) for r, s in zip(records, states)],
                        }
                    )
                else:
                    sel = (
                        f"--job {args.job}"
                        if args.job
                        else ("--all" if args.all else "--pid " + ",".join(str(r.pid) for r in records))
                    )
                    print(f"dynprof: tracing in {len(records)} process(es); end it with `dynprof stop {sel}`")
                return 0
            if time.monotonic() > deadline:
                progress.done()
                raise errors.Timeout(
                    f"the trace was not active after {args.timeout or 120:g} s",
                    help="Check that the process is stepping (`dynprof ps`); the request stays "
                    "armed until the hard cap.",
                )
            progress.update(f"waiting for the trace to start: {len(active)}/{len(records)} active")
            time.sleep(POLL_S)

    def _wait_done(
        self,
        args: argparse.Namespace,
        clients: list[AgentClient],
        records: list[AgentRecord],
        group_id: str,
        steps: int,
        at_step: int,
    ) -> int:
        deadline = time.monotonic() + args.timeout if args.timeout else None
        progress = Progress(enabled=not args.json)
        results: dict[int, dict[str, Any]] = {}
        try:
            while len(results) < len(records):
                pending = [(r, c) for r, c in zip(records, clients) if r.pid not in results]
                states = parallel(lambda rc: rc[1].status(), pending)
                parts = []
                for (record, _), st in zip(pending, states):
                    if isinstance(st, Exception):
                        # The process is gone (it exited, or was killed): a trace it flushed on
                        # the way out is in the store under this request's group.
                        results[record.pid] = _result_from_store(record, group_id, at_step) or {
                            **_target(record, at_step),
                            "status": "failed",
                            "artifact": None,
                            "error": f"lost contact with the process before it wrote a trace: {st}",
                        }
                        continue
                    t = st.trace
                    if t.group_id == group_id and t.state == "idle":
                        results[record.pid] = {
                            **_target(record, t.start_step),
                            "status": t.last_artifact_status or "failed",
                            "artifact": t.last_artifact or None,
                            "error": t.last_error or None,
                        }
                        continue
                    label = f"rank {record.rank}" if record.rank is not None else f"pid {record.pid}"
                    if t.state == "armed":
                        parts.append(f"{label}: armed, at step {st.step}, starts after {t.start_step}")
                    elif steps:
                        parts.append(f"{label}: {t.state} {t.steps_done}/{steps} steps")
                    else:
                        parts.append(f"{label}: {t.state}")
                if parts:
                    # The states come from the processes: shown escaped, like all text from them.
                    progress.update(
                        printable("; ".join(parts[:4]) + (f"; +{len(parts) - 4} more" if len(parts) > 4 else ""))
                    )
                if len(results) == len(records):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    progress.done()
                    raise errors.Timeout(
                        f"gave up waiting after {args.timeout:g} s; the trace continues and ends by itself",
                        help="Find its artifact later with `dynprof ls --kind trace`.",
                    )
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            progress.done()
            parallel(lambda c: c.request(stop_trace=pb.StopTraceRequest()), clients)
            raise errors.DynprofError(
                "interrupted: asked the processes to stop the trace early",
                help="The partial traces are listed by `dynprof ls --kind trace`.",
            ) from None
        progress.done()
        ordered = [results[r.pid] for r in records]
        if args.json:
            print_json({"group_id": group_id, "results": ordered})
        else:
            for res in ordered:
                who = f"rank {res['rank']} (pid {res['pid']})" if res["rank"] is not None else f"pid {res['pid']}"
                if res["artifact"]:
                    print(printable(f"{who}: {res['status']}: {res['artifact']}"))
                else:
                    print(printable(f"{who}: failed: {res['error']}"))
        return 0 if all(r["status"] == "complete" for r in ordered) else 1


def _result_from_store(record: AgentRecord, group_id: str, at_step: int) -> dict[str, Any] | None:
    """The trace artifact this request's group left for ``record``'s process, if any."""
    try:
        from dynprof.store import ArtifactStore

        found = [
            a
            for a in ArtifactStore().list(kind="trace")
            if a.manifest.get("pid") == record.pid and (a.manifest.get("options") or {}).get("group_id") == group_id
        ]
    except Exception:
        return None
    if not found:
        return None
    art = found[0]  # newest first
    summary = art.manifest.get("summary") or {}
    return {
        **_target(record, int(summary.get("start_step") or at_step)),
        "status": art.status,
        "artifact": str(art.path),
        "error": art.manifest.get("error")
        or (f"the process exited; stopped by {summary.get('stopped_by')}" if art.status != "complete" else None),
    }


def _target(record: AgentRecord, start_step: int) -> dict[str, Any]:
    return {"pid": record.pid, "rank": record.rank, "job": record.job_id, "start_step": start_step}


def _check(statuses: list[Any], records: list[AgentRecord]) -> list[Any]:
    for st in statuses:
        if isinstance(st, Exception):
            raise st
    return statuses


def _cancel(clients: list[AgentClient], replies: list[Any]) -> None:
    accepted = [c for c, r in zip(clients, replies) if not isinstance(r, Exception)]
    parallel(lambda c: c.request(stop_trace=pb.StopTraceRequest()), accepted)
