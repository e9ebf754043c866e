"""A trace of N steps on every rank of every node, all from the same step.

:func:`arm_at_one_step` reads every rank's step (``ps`` on every node), picks the smallest step
every rank still reaches (:mod:`collectors.torch_trace.align`), arms every node at it (``start --no-wait
--at-step S``), and when a node finds that step already passed, cancels the others and arms
again further ahead. :func:`follow_traces` then follows each armed rank through its node's
``ps`` (its trace group, start step and outcome) until its trace is written, its node stops
answering, or the wait ends.

The options sent to the nodes are the command's own, given by the caller (the CLI face turns
its parsed options into them); this module only plans and follows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from collectors.torch_trace import collect as kind
from collectors.torch_trace.align import ALIGN_LEAD_S, ALIGN_RETRIES, MAX_STEP_NUMBER, alignment_step, step_time_of_ms
from collectors.torch_trace.collect import Started, TraceRequest
from dynprof import errors, output, roles
from dynprof.job.answers import int_or_none, node_labels, rank_key, read
from dynprof.job.client import SidecarClient
from dynprof.job.merge import (
    JobResult,
    Reach,
    envelope,
    exit_code,
    fetched_doc,
    maybe_fetch,
    node_messages,
    per_rank_result,
    with_fetch,
)
from dynprof.job.ps import Agents
from dynprof.nodes import Node, NodeAnswer

# How far ahead the common start step is put: the fan-out round trip (ps, then start) is
# measured, doubled, and added to the single-node lead; each retry after a node found the
# step already passed puts it four times further.
START_LEAD_MIN_S = 1.0
START_WAIT_DEFAULT_S = 600.0
START_ARM_TIMEOUT_S = 30.0
START_POLL_S = 0.5
START_SILENCE_MIN_S = 30.0
PS_TIMEOUT_S = 2.0
"""How long each node's ps waits for its agents while planning and following."""

NO_RANK_STEPPED = "no rank of the job has stepped an optimizer yet on any node"


class Progress(Protocol):
    def update(self, text: str) -> None: ...

    def done(self) -> None: ...


@dataclass
class Armed:
    """What arming found: the common step (None when no rank has stepped and none was given),
    the plan's figures, each node's answer to its last arming, and the ranks seen stepping."""

    at_step: int | None
    lead_s: float
    round_trip_s: float
    attempts: list[dict[str, Any]]
    answers: list[NodeAnswer]
    stepping: list[dict[str, Any]]
    messages: list[str] = field(default_factory=list)

    def plan(self) -> dict[str, Any]:
        return {"lead_s": round(self.lead_s, 3), "round_trip_s": round(self.round_trip_s, 3), "attempts": self.attempts}


def steps_of(
    client: SidecarClient, nodes: list[Node], labels: dict[Node, str], ps_options: dict[str, Any], job: str | None
) -> list[dict[str, Any]]:
    """Every trainer rank of the job that has stepped, on every node that answers: its step and
    step time (0 when the node gives none that is a step time)."""
    out = []
    for a in client.action_all(nodes, "ps", ps_options, timeout=PS_TIMEOUT_S + 1.0):
        got = read(a, Agents.from_json)
        for row in got.agents if got is not None else []:
            if job and row.get("job") != job:
                continue
            step = int_or_none(row.get("step"))
            if step is None or not 0 < step < MAX_STEP_NUMBER or row.get("state") in ("error", "unresponsive"):
                continue
            if row.get("role") not in (None, roles.TRAINER):  # a launcher's or worker's agent never leads
                continue
            out.append(
                {
                    "node": labels[a.node],
                    "rank": int_or_none(row.get("rank")),
                    "pid": int_or_none(row.get("pid")),
                    "step": step,
                    "step_time_s": step_time_of_ms(row.get("step_time_ms")) or 0.0,
                }
            )
    return out


def arm_at_one_step(
    client: SidecarClient,
    nodes: list[Node],
    labels: dict[Node, str],
    *,
    at_step: int | None,
    job: str | None,
    select_all: bool,
    start_options: dict[str, Any],
    ps_options: dict[str, Any],
    progress: Progress,
) -> Armed:
    """Arm every node at one step: ``at_step`` when given, else the one planned from the ranks'
    steps, retried further ahead (at most ``ALIGN_RETRIES`` times) when a node finds it passed.
    ``start_options``: the start action's options but the step (``no_wait`` and its timeout set)."""
    given = at_step
    lead, rtt = START_LEAD_MIN_S, 0.0
    stepping: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    messages: list[str] = []
    answers: list[NodeAnswer] = []
    for attempt in range(ALIGN_RETRIES):
        if given is None:
            t0 = time.monotonic()
            stepping = steps_of(client, nodes, labels, ps_options, job)
            rtt = max(rtt, time.monotonic() - t0)
            if not stepping:
                messages.append(NO_RANK_STEPPED)
                at_step = None
            else:
                if attempt == 0:
                    lead = max(START_LEAD_MIN_S, ALIGN_LEAD_S + 2.0 * rtt)
                statuses = [SimpleNamespace(step=r["step"], step_time_s=r["step_time_s"]) for r in stepping]
                at_step = alignment_step(statuses, lead)
        progress.update(f"arming {len(nodes)} node(s) at step {at_step}")
        t0 = time.monotonic()
        options = {k: v for k, v in start_options.items() if k != "at_step"}
        if at_step is not None:
            options["at_step"] = at_step
        answers = client.action_all(nodes, "start", options, timeout=START_ARM_TIMEOUT_S)
        rtt = max(rtt, time.monotonic() - t0)
        failed = [a for a in answers if not a.ok]
        attempts.append({"at_step": at_step, "lead_s": round(lead, 3), "failed_nodes": [str(a.node) for a in failed]})
        if not failed or given is not None or at_step is None or attempt + 1 == ALIGN_RETRIES:
            break
        # Did a failed node find the step already passed? Its ranks' steps say so.
        failed_labels = {labels[a.node] for a in failed if a.answered}
        stepping = steps_of(client, nodes, labels, ps_options, job)
        if not any(r["node"] in failed_labels and r["step"] >= at_step for r in stepping):
            break
        armed = [a.node for a in answers if a.ok]
        progress.update(f"step {at_step} passed on some node: cancelling and arming further ahead")
        client.action_all(armed, "stop", {"job": job, "all": select_all, "no_wait": True}, timeout=30.0)
        lead *= 4
    return Armed(at_step, lead, rtt, attempts, answers, stepping, messages)


def follow_traces(
    client: SidecarClient,
    nodes: list[Node],
    labels: dict[Node, str],
    armed: Armed,
    *,
    ps_options: dict[str, Any],
    no_wait: bool,
    timeout: float | None,
    node_timeout: float,
    progress: Progress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per armed rank, the trace it got, followed through each node's ps until written (its row
    names its trace group, start step and outcome: ``trace``); and the ranks that missed the
    common step, each with its reason (the nodes that were not armed included)."""
    at_step = armed.at_step
    pending: dict[tuple[str, int], dict[str, Any]] = {}
    groups: dict[str, Any] = {}
    for a in armed.answers:
        started = read(a, Started.from_json) if a.ok else None
        if started is None:
            continue
        label = labels[a.node]
        groups[label] = started.group_id
        for row in started.targets or []:
            pid = int_or_none(row.get("pid"))
            if pid is None:
                continue
            pending[(label, pid)] = {
                "rank": int_or_none(row.get("rank")),
                "pid": pid,
                "job": row.get("job"),
                "node": label,
                "start_step": int_or_none(row.get("start_step")),
                "status": "armed",
                "artifact": None,
                "error": None,
            }
    done: list[dict[str, Any]] = []
    if no_wait:
        done = list(pending.values())
        pending = {}
    wait = timeout or START_WAIT_DEFAULT_S
    deadline = time.monotonic() + wait
    by_label = {labels[n]: n for n in nodes}
    # A node that misses a poll is asked again; one silent this long is given up.
    silence_limit = max(START_SILENCE_MIN_S, 3 * node_timeout)
    last_heard = {label: time.monotonic() for label, _ in pending}
    while pending:
        asked = sorted({label for label, _ in pending})
        answers = client.action_all([by_label[label] for label in asked], "ps", ps_options, timeout=PS_TIMEOUT_S + 1.0)
        for a in answers:
            label = labels[a.node]
            if not a.answered:
                if time.monotonic() - last_heard[label] > silence_limit:
                    for key in [k for k in pending if k[0] == label]:
                        res = pending.pop(key)
                        res.update(
                            status="failed",
                            error=f"the node stopped answering for {silence_limit:g} s: {a.error}",
                        )
                        done.append(res)
                continue
            last_heard[label] = time.monotonic()
            listed = set()
            got = read(a, Agents.from_json)
            for row in got.agents if got is not None else []:
                key = (label, int_or_none(row.get("pid")) or 0)
                listed.add(key)
                if key not in pending:
                    continue
                trace = row.get("trace")
                if not isinstance(trace, dict) or trace.get("group_id") != groups[label] or row.get("state") != "idle":
                    continue
                artifact = row.get("last_artifact") if isinstance(row.get("last_artifact"), str) else None
                res = pending.pop(key)
                res.update(
                    status=str(trace.get("last_artifact_status") or "failed"),
                    artifact=artifact,
                    error=str(trace["last_error"])[:2000] if trace.get("last_error") else None,
                    start_step=int_or_none(trace.get("start_step")) or res["start_step"],
                )
                done.append(res)
            for key in [k for k in pending if k[0] == label and k not in listed]:
                res = pending.pop(key)
                res.update(status="failed", error="the process left the node's agent list before its trace was written")
                done.append(res)
        if not pending:
            break
        if time.monotonic() > deadline:
            for res in pending.values():
                res.update(status="timeout", error=f"not written within {wait:g} s")
                done.append(res)
            break
        progress.update(f"tracing from step {at_step}: {len(done)}/{len(done) + len(pending)} rank(s) written")
        time.sleep(START_POLL_S)
    progress.done()
    done.sort(key=rank_key)
    ok = ("complete", "partial", "armed") if no_wait else ("complete", "partial")
    missed = []
    for res in done:
        if res["status"] not in ok:
            missed.append({"rank": res["rank"], "pid": res["pid"], "node": res["node"], "reason": res["error"]})
        elif at_step and res["start_step"] != at_step:
            missed.append(
                {
                    "rank": res["rank"],
                    "pid": res["pid"],
                    "node": res["node"],
                    "reason": f"armed at step {res['start_step']}, not {at_step}",
                }
            )
    for a in armed.answers:
        if a.ok:
            continue
        why = a.error if not a.answered else a.command_error() or "no trace started"
        ranks = [r for r in armed.stepping if r["node"] == labels[a.node]] or [{"rank": None, "pid": None}]
        missed.extend({"rank": r["rank"], "pid": r["pid"], "node": labels[a.node], "reason": why} for r in ranks)
    missed.sort(key=rank_key)
    return done, missed


# -- the start of a trace, on this node and job-wide -------------------------------------------
def collect(request: TraceRequest, progress: Any = None) -> Started:
    """This node's start of ``request``, followed (``progress``: where it says so meanwhile)."""
    return kind.collect(request, progress)


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Steps mode: one start step for every rank of every node (:mod:`dynprof.job.start`),
    then each rank's trace followed until written. Duration and open-ended traces go to
    every node as they are. ``options``: the action's (what the CLI's flags say)."""
    if not options.get("job") and not options.get("all"):
        raise errors.UsageError("with --hosts, select the ranks with --job JOB (or --all)")
    if options.get("duration") is not None and options.get("at_step") is not None:
        raise errors.UsageError("--at-step applies to step mode, not to --duration")
    request = TraceRequest.from_json(options)
    client = reach.client
    if not request.steps:
        # --duration, or until `dynprof stop`: every node starts its ranks as it would alone.
        wait = options.get("timeout") or START_WAIT_DEFAULT_S
        answers = client.action_all(nodes, "start", {**options, "timeout": wait}, timeout=wait + 5.0)
        result = per_rank_result(reach, request.job, nodes, answers, Started.from_json, ("results", "targets"))
        result.context["as_is"] = True
        return result
    labels = node_labels(nodes)
    progress = output.Progress(enabled=reach.progress)
    ps_options = {**({"job": request.job} if request.job else {}), "timeout": PS_TIMEOUT_S}
    arm_options = {k: v for k, v in options.items() if k != "at_step"}
    armed = arm_at_one_step(
        client,
        nodes,
        labels,
        at_step=options.get("at_step"),
        job=request.job,
        select_all=request.all,
        start_options={**arm_options, "no_wait": True, "timeout": START_ARM_TIMEOUT_S},
        ps_options=ps_options,
        progress=progress,
    )
    results, missed = follow_traces(
        client,
        nodes,
        labels,
        armed,
        ps_options=ps_options,
        no_wait=request.no_wait,
        timeout=options.get("timeout"),
        node_timeout=reach.node_timeout,
        progress=progress,
    )
    address = {labels[n]: n.address for n in nodes}
    artifacts = [
        {"node": r["node"], "node_address": address[r["node"]], "path": r["artifact"]}
        for r in results
        if isinstance(r.get("artifact"), str) and r["artifact"]
    ]
    fetched = maybe_fetch(reach, request.job, armed.answers, artifacts)
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
    return JobResult(doc, code, messages, context={"steps": request.steps})
