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
import os
import re
import time
import uuid
from typing import Any

from collectors.torch_trace import WRITING_AT_EXIT, result_from_store, target_row
from dynprof import errors
from dynprof.cli._common import (
    MAX_SECONDS,
    MAX_STEP_NUMBER,
    MAX_TRACE_STEPS,
    Progress,
    add_attach_flag,
    add_targets,
    bounded_int,
    parallel,
    printable,
    resolve_agents,
    seconds,
)
from dynprof.cli.job import (
    JobCommand,
    JobResult,
    Text,
    envelope,
    exit_code,
    fetched_doc,
    forward_options,
    maybe_fetch,
    node_messages,
    per_rank_result,
    render_per_rank,
    who,
    with_fetch,
)
from dynprof.client import AgentClient
from dynprof.job.align import ALIGN_LEAD_S, ALIGN_RETRIES, aligned_steps, alignment_step, boundary_offsets
from dynprof.nodes import Node
from dynprof.proto import pb
from dynprof.registry import AgentRecord
from dynprof.result import Result

POLL_S = 0.1


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
        if args.at_step is not None and args.duration is not None:
            raise errors.UsageError("--at-step applies to step mode, not to --duration")
        records = resolve_agents(args)
        clients = [AgentClient.for_record(r, timeout=5.0) for r in records]
        statuses = _check(parallel(lambda c: c.status(), clients), records)
        steps = args.steps or 0
        duration = args.duration or 0.0
        messages: list[str] = []
        if not args.pid and not duration and len(records) > 1:
            # Among the processes of a job, those that never stepped an optimizer (a launcher,
            # data-loader workers started with spawn) would wait for a step that never comes.
            stepping = [s.step > 0 for s in statuses]
            if any(stepping) and not all(stepping):
                skipped = [r.pid for r, ok in zip(records, stepping) if not ok]
                messages.append(
                    f"skipping {len(skipped)} process(es) that have not stepped an optimizer "
                    f"(a launcher or data-loader worker?): pid {', '.join(map(str, skipped))}"
                )
                keep = [i for i, ok in enumerate(stepping) if ok]
                records = [records[i] for i in keep]
                clients = [clients[i] for i in keep]
                statuses = [statuses[i] for i in keep]
        align = len(records) > 1 and duration == 0 and all(s.step_hook_installed and s.step > 0 for s in statuses)
        at_step = args.at_step or 0
        group_id = uuid.uuid4().hex[:12]
        if args.sample_keep:
            from dynprof.watch.straggler import SAMPLE_GROUP_PREFIX, prune_sample_traces

            group_id = SAMPLE_GROUP_PREFIX + group_id
            job = args.job or (records[0].job_id if records else None)
            if job:
                gone = prune_sample_traces(job, args.sample_keep - 1, set(args.keep_groups))
                if gone:
                    messages.append(f"deleted {len(gone)} older straggler-sample trace(s) of job {job}")
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
        requested = (
            f"dynprof: trace of {what} requested from {len(records)} process(es), starting {where} (group {group_id})"
        )
        if args.no_wait:
            doc = {
                "group_id": group_id,
                "at_step": at_step,
                "state": "armed",
                "targets": [target_row(r, started[r.pid].start_step) for r in records],
            }
            return JobResult(doc, 0, messages, context={"requested": requested})
        if not steps and not duration:
            doc = self._wait_active(args, clients, records, group_id)
            sel = (
                f"--job {args.job}"
                if args.job
                else ("--all" if args.all else "--pid " + ",".join(str(r.pid) for r in records))
            )
            n_active = len(doc["targets"])
            active = (
                f"dynprof: tracing in {n_active} process(es); end it with `dynprof stop {sel}`"
                if n_active
                else "dynprof: the trace already ended: the process(es) exited while tracing"
            )
            code = 0 if all(r["artifact"] and r["status"] != "failed" for r in doc.get("results", [])) else 1
            return JobResult(doc, code, messages, context={"requested": requested, "active": active})
        doc = self._wait_done(args, clients, records, group_id, steps, at_step)
        code = 0 if all(r["status"] == "complete" for r in doc["results"]) else 1
        return JobResult(doc, code, messages, context={"requested": requested})

    def collect_nodes(self, args: argparse.Namespace, nodes: list[Node]) -> Result:
        """Steps mode: one start step for every rank of every node (:mod:`dynprof.job.start`),
        then each rank's trace followed until written. Duration and open-ended traces go to
        every node as they are."""
        from dynprof.job import start as job_start
        from dynprof.job.answers import node_labels

        if not args.job and not args.all:
            raise errors.UsageError("with --hosts, select the ranks with --job JOB (or --all)")
        if args.duration is not None and args.at_step is not None:
            raise errors.UsageError("--at-step applies to step mode, not to --duration")
        client = self.client(args)
        if not args.steps:
            # --duration, or until `dynprof stop`: every node starts its ranks as it would alone.
            wait = args.timeout or job_start.START_WAIT_DEFAULT_S
            options = forward_options("start", args, timeout=wait)
            answers = client.action_all(nodes, "start", options, timeout=wait + 5.0)
            result = per_rank_result(args, client, nodes, answers, ("results", "targets"))
            result.context["as_is"] = True
            return result
        labels = node_labels(nodes)
        progress = Progress(enabled=not getattr(args, "json", False))
        ps_options = forward_options("ps", args, timeout=job_start.PS_TIMEOUT_S)
        armed = job_start.arm_at_one_step(
            client,
            nodes,
            labels,
            at_step=args.at_step,
            job=args.job,
            select_all=args.all,
            start_options=forward_options(
                "start", args, at_step=None, no_wait=True, timeout=job_start.START_ARM_TIMEOUT_S
            ),
            ps_options=ps_options,
            progress=progress,
        )
        results, missed = job_start.follow_traces(
            client,
            nodes,
            labels,
            armed,
            ps_options=ps_options,
            no_wait=args.no_wait,
            timeout=args.timeout,
            node_timeout=args.node_timeout,
            progress=progress,
        )
        address = {labels[n]: n.address for n in nodes}
        artifacts = [
            {"node": r["node"], "node_address": address[r["node"]], "path": r["artifact"]}
            for r in results
            if isinstance(r.get("artifact"), str) and r["artifact"]
        ]
        fetched = maybe_fetch(args, client, armed.answers, artifacts)
        code = with_fetch(exit_code(armed.answers), fetched)
        if missed and code == 0:
            code = 1
        doc = {
            **envelope(armed.answers, strip=("targets",)),
            "at_step": armed.at_step,
            "plan": armed.plan(),
            "results": results,
            "missed": missed,
            "artifacts": artifacts,
            **fetched_doc(fetched),
        }
        messages = armed.messages + node_messages(armed.answers)
        return JobResult(doc, code, messages, context={"steps": args.steps})

    def render(self, result: Result) -> str:
        doc = result.to_json()
        context = result.context if isinstance(result, JobResult) else {}
        if context.get("as_is"):
            return render_per_rank(result, _as_is_line)
        if "nodes" in doc:
            return _render_nodes(doc, context["steps"])
        lines = [context["requested"]] if "requested" in context else []
        if "active" in context:
            lines.append(context["active"])
        for res in doc.get("results", []):
            who = f"rank {res['rank']} (pid {res['pid']})" if res["rank"] is not None else f"pid {res['pid']}"
            if res["artifact"]:
                lines.append(printable(f"{who}: {res['status']}: {res['artifact']}"))
            else:
                lines.append(printable(f"{who}: failed: {res['error']}"))
        return "\n".join(lines)

    def _wait_active(
        self, args: argparse.Namespace, clients: list[AgentClient], records: list[AgentRecord], group_id: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + (args.timeout or 120.0)
        progress = Progress(enabled=not getattr(args, "json", False))
        ended: dict[int, dict[str, Any]] = {}  # pid -> the trace it already wrote
        while True:
            pending = [(r, c) for r, c in zip(records, clients) if r.pid not in ended]
            states = parallel(lambda rc: rc[1].status().trace, pending)
            active = [s for s in states if not isinstance(s, Exception) and s.state == "tracing"]
            failed = []
            for (record, _), s in zip(pending, states):
                # A trace that started and ended between two looks (a job that exits mid-trace):
                # once the process is gone, its trace is in the store; an idle agent names it.
                done: dict[str, Any] | None = None
                if isinstance(s, Exception):
                    if _alive(record.pid):
                        continue  # its agent stopped answering during its exit: looked at again
                    done = result_from_store(record, group_id, 0)
                elif s.state == "idle" and s.group_id == group_id:
                    if s.last_artifact:
                        done = {
                            **target_row(record, s.start_step),
                            "status": s.last_artifact_status or "failed",
                            "artifact": s.last_artifact,
                            "error": s.last_error or None,
                        }
                elif (
                    s.state == "exporting"
                    and s.group_id == group_id
                    and s.last_artifact_status == WRITING_AT_EXIT
                    and s.last_artifact
                ):
                    # it ran, and the job's exit is writing it now
                    done = {
                        **target_row(record, s.start_step),
                        "status": WRITING_AT_EXIT,
                        "artifact": s.last_artifact,
                        "error": None,
                    }
                else:
                    continue
                if done is not None:
                    ended[record.pid] = done
                else:
                    failed.append((record, s))
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
            if len(active) + len(ended) == len(records):
                progress.done()
                doc: dict[str, Any] = {
                    "group_id": group_id,
                    "state": "tracing" if active else "ended",
                    "targets": [
                        target_row(r, s.start_step)
                        for (r, _), s in zip(pending, states)
                        if not isinstance(s, Exception) and s.state == "tracing"
                    ],
                }
                if ended:
                    doc["results"] = [ended[r.pid] for r in records if r.pid in ended]
                return doc
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
    ) -> dict[str, Any]:
        deadline = time.monotonic() + args.timeout if args.timeout else None
        progress = Progress(enabled=not getattr(args, "json", False))
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
                        results[record.pid] = result_from_store(record, group_id, at_step) or {
                            **target_row(record, at_step),
                            "status": "failed",
                            "artifact": None,
                            "error": f"lost contact with the process before it wrote a trace: {st}",
                        }
                        continue
                    t = st.trace
                    if t.group_id == group_id and t.state == "idle":
                        results[record.pid] = {
                            **target_row(record, t.start_step),
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
        return {"group_id": group_id, "results": [results[r.pid] for r in records]}


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read(4096).rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc here: kill(0) said it exists
    return state not in ([b"Z"], [b"X"])


def _check(statuses: list[Any], records: list[AgentRecord]) -> list[Any]:
    for st in statuses:
        if isinstance(st, Exception):
            raise st
    return statuses


def _cancel(clients: list[AgentClient], replies: list[Any]) -> None:
    accepted = [c for c, r in zip(clients, replies) if not isinstance(r, Exception)]
    parallel(lambda c: c.request(stop_trace=pb.StopTraceRequest()), accepted)


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
        detail = r.get("artifact") or r.get("error") or ""
        text.print(printable(f"{who(r)} on {r['node']}: from step {r.get('start_step')}: {r.get('status')}: {detail}"))
    for m in doc["missed"]:
        rank = f"rank {m['rank']}" if m.get("rank") is not None else "ranks"
        text.print(printable(f"MISSED {rank} on {m['node']}: {m['reason']}"))
    text.artifacts([], doc.get("fetched"))
    text.footer(doc)
    return text.value()
