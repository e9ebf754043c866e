"""Start a torch.profiler trace in this node's processes, and follow it: the trace kind's one
policy for a start, whoever asks (``dynprof start``, the sidecar's ``start`` action, the watch's
straggler samples on this node).

    >>> started = collect(TraceRequest(job="j1", steps=5))       # doctest: +SKIP
    >>> [r["artifact"] for r in started.results or []]             # doctest: +SKIP

Several processes of a job stepping an optimizer start at one common step (by each process's
own step count when some were attached: aligned by their step boundaries' times). A process
that never stepped is left out of a step-mode trace of a job, and said so.

Not imported by ``collectors.torch_trace`` itself: the agent, which imports that package, never
loads this policy.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from collectors.torch_trace import SWITCHES, WRITING_AT_EXIT, TraceOptions, result_from_store, target_row
from collectors.torch_trace.align import ALIGN_LEAD_S, ALIGN_RETRIES, aligned_steps, alignment_step, boundary_offsets
from collectors.torch_trace.samples import SAMPLE_GROUP_PREFIX, prune_sample_traces
from dynprof import errors
from dynprof.agents import parallel, resolve
from dynprof.arguments import MAX_SECONDS, MAX_STEP_NUMBER, MAX_TRACE_STEPS
from dynprof.client import AgentClient
from dynprof.output import printable
from dynprof.proto import pb
from dynprof.registry import AgentRecord, pid_alive
from dynprof.requests import TARGETS, TargetedRequest, check_timeout, read_options
from dynprof.result import Result
from dynprof.safetext import shell_word

POLL_S = 0.1
ACTIVITIES = ("cpu", "cuda", "xpu")
MAX_SAMPLE_KEEP = 64
_SAMPLE_GROUP = re.compile(SAMPLE_GROUP_PREFIX + r"[0-9a-f]{12}")
# A trace that ends is written by its agent; torch's writer holds the process's interpreter,
# so the agent cannot answer until it is done (about 5 us per recorded event on a 2-core
# machine). A process that runs on while its agent is silent is waited for this long at least,
# plus this much per second the trace recorded, at most the last; then the command says the
# trace is still being written (status WRITING), never that it failed.
WRITE_WAIT_MIN_S = 60.0
WRITE_WAIT_PER_PROFILED_S = 3.0
WRITE_WAIT_MAX_S = 3600.0
WRITING = "writing"
DEFAULT_ACTIVE_WAIT_S = 120.0  # an open-ended trace is waited for until active, this long unless given


@dataclass(frozen=True)
class TraceRequest(TargetedRequest):
    """Which processes: exactly one of ``pids``, ``job`` (its trainers on this node) or ``all``.
    How long: ``steps`` optimizer steps (from ``at_step``, else the next boundary), or
    ``duration`` seconds, or neither (until `dynprof stop`). What torch.profiler records (the
    ``record_shapes`` ... ``activities`` options), the agent's hard cap (``max_duration``),
    whether to wait (``no_wait``; ``timeout``: how long), and for a watch's straggler sample
    (``sample_keep``) the older samples of the job this node keeps (``keep_groups``). Checked
    when made: a bad request raises :class:`~dynprof.errors.UsageError`."""

    steps: int = 0
    duration: float = 0.0
    at_step: int = 0
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    with_flops: bool = False
    with_modules: bool = False
    activities: tuple[str, ...] = ()
    max_duration: float = 0.0
    no_wait: bool = False
    timeout: float | None = None
    sample_keep: int = 0
    keep_groups: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.check_one_target("start")
        if self.steps and self.duration:
            raise errors.UsageError("give --steps or --duration, not both")
        if self.at_step and self.duration:
            raise errors.UsageError("--at-step applies to step mode, not to --duration")
        if not 0 <= self.steps <= MAX_TRACE_STEPS:
            raise errors.UsageError(f"--steps is 1..{MAX_TRACE_STEPS:,}")
        if not 0 <= self.at_step <= MAX_STEP_NUMBER:
            raise errors.UsageError(f"--at-step is 1..{MAX_STEP_NUMBER}")
        for name, value in (("--duration", self.duration), ("--max-duration", self.max_duration)):
            if not 0 <= value <= MAX_SECONDS:
                raise errors.UsageError(f"{name} {value:g}: at most {MAX_SECONDS:g} s")
        if self.timeout is not None:
            check_timeout(self.timeout)
        self.check_pids()
        bad = [a for a in self.activities if a not in ACTIVITIES]
        if bad:
            raise errors.UsageError(f"unknown activity {bad[0][:40]!a} (choose from {', '.join(ACTIVITIES)})")
        if not 0 <= self.sample_keep <= MAX_SAMPLE_KEEP:
            raise errors.UsageError(f"--sample-keep is 1..{MAX_SAMPLE_KEEP}")
        if len(self.keep_groups) > MAX_SAMPLE_KEEP or not all(
            isinstance(g, str) and _SAMPLE_GROUP.fullmatch(g) for g in self.keep_groups
        ):
            raise errors.UsageError(
                f"--keep-groups: at most {MAX_SAMPLE_KEEP} sample groups, each sample- and 12 hex digits"
            )

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "steps": "int",
        "duration": "float",
        "at_step": "int",
        "record_shapes": "bool",
        "with_stack": "bool",
        "profile_memory": "bool",
        "with_flops": "bool",
        "with_modules": "bool",
        "activities": "strs",
        "max_duration": "float",
        "no_wait": "bool",
        "timeout": "float",
        "sample_keep": "int",
        "keep_groups": "strs",
    }
    _SWITCHES = (*SWITCHES, "no_wait")

    @classmethod
    def from_json(cls, doc: Any) -> TraceRequest:
        """The request of a JSON object of the ``start`` action's options (:meth:`to_json`). A
        number given is a real one (``steps``, ``at_step``, ``sample_keep`` at least 1,
        ``duration`` and ``max_duration`` more than 0): leaving it out is how to leave it unset."""
        o = read_options(doc, cls.OPTIONS, "start")
        for key in ("steps", "at_step", "sample_keep", "duration", "max_duration"):
            if key in o and o[key] <= 0:
                raise errors.UsageError(f"start: option {key!r} must be more than 0 (leave it out to leave it unset)")
        # a list item may hold several names, comma-separated, as the command line's value does
        activities = [a.strip().lower() for item in o.get("activities", ()) for a in item.split(",") if a.strip()]
        groups = [g.strip() for item in o.get("keep_groups", ()) for g in item.split(",") if g.strip()]
        return cls(
            **cls.targets_of(o),
            steps=o.get("steps", 0),
            duration=o.get("duration", 0.0),
            at_step=o.get("at_step", 0),
            activities=tuple(activities),
            max_duration=o.get("max_duration", 0.0),
            timeout=o.get("timeout"),
            sample_keep=o.get("sample_keep", 0),
            keep_groups=tuple(groups),
            **{key: o.get(key, False) for key in cls._SWITCHES},
        )

    def to_json(self) -> dict[str, Any]:
        """The request as the ``start`` action's options (those left unset out)."""
        out = self.targets_json()
        for key in ("steps", "duration", "at_step", "max_duration", "sample_keep"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        out.update({key: True for key in self._SWITCHES if getattr(self, key)})
        if self.activities:
            out["activities"] = list(self.activities)
        if self.keep_groups:
            out["keep_groups"] = list(self.keep_groups)
        if self.timeout is not None:
            out["timeout"] = self.timeout
        return out


@dataclass
class Started(Result):
    """A start's answer on this node: its trace group (``group_id``); armed (``no_wait``: the
    step it is armed at, ``at_step``), active or ended (``state``); the processes armed or
    tracing (``targets``) and the traces written (``results``: pid, rank, job, start_step,
    status, artifact, error, and a note while one is still being written); the exit code it
    means (0: every trace complete) and what is worth saying besides (``messages``). For the
    text only: what was requested, and how to end an open-ended trace (``active``)."""

    group_id: str | None = None
    state: str | None = None  # "armed", "tracing", "ended"; None: the traces were waited for
    at_step: int | None = None  # the step an armed trace starts after (state "armed")
    targets: list[dict[str, Any]] | None = None
    results: list[dict[str, Any]] | None = None
    requested: str = ""
    active: str | None = None

    def to_json(self) -> dict[str, Any]:
        """``dynprof start --json`` on one node, the sidecar's ``start`` answer: ``group_id``,
        then ``at_step`` (armed only), ``state``, ``targets`` and ``results``, each where it is set."""
        out: dict[str, Any] = {"group_id": self.group_id}
        if self.state == "armed":
            out["at_step"] = self.at_step
        if self.state is not None:
            out["state"] = self.state
        if self.targets is not None:
            out["targets"] = self.targets
        if self.results is not None:
            out["results"] = self.results
        return out

    @classmethod
    def from_json(cls, doc: Any) -> Started:
        """A node's answer, untrusted: an object with a list ``targets`` or ``results`` (their
        rows that are objects kept, as they are), else :class:`~dynprof.errors.ArtifactError`;
        ``group_id`` and ``state`` taken when strings, ``at_step`` when an integer."""
        if not isinstance(doc, dict):
            raise errors.ArtifactError("the start answer is not a JSON object")
        targets, results = doc.get("targets"), doc.get("results")
        if not isinstance(targets, list) and not isinstance(results, list):
            raise errors.ArtifactError("the start answer has no list 'targets' or 'results'")
        group, state, at_step = doc.get("group_id"), doc.get("state"), doc.get("at_step")
        return cls(
            group_id=group if isinstance(group, str) else None,
            state=state if isinstance(state, str) else None,
            at_step=at_step if isinstance(at_step, int) and not isinstance(at_step, bool) else None,
            targets=[dict(r) for r in targets if isinstance(r, dict)] if isinstance(targets, list) else None,
            results=[dict(r) for r in results if isinstance(r, dict)] if isinstance(results, list) else None,
        )

    def rank_rows(self) -> list[dict[str, Any]]:
        """The rows a job-wide answer merges rank by rank: the traces written, else the
        processes armed or tracing."""
        return self.results or self.targets or []

    def artifact_paths(self) -> list[Any]:
        return [r.get("artifact") for r in self.results or []]


class ProgressLine(Protocol):
    """Where a start says what the processes are doing while it waits (one line, rewritten)."""

    def update(self, text: str) -> None: ...

    def done(self) -> None: ...


class _Quiet:
    def update(self, text: str) -> None:
        pass

    def done(self) -> None:
        pass


def collect(request: TraceRequest, progress: ProgressLine | None = None) -> Started:
    """Start the trace ``request`` asks for in each process it names, and (unless ``no_wait``)
    follow it: until every trace is written (steps or duration), or active (an open-ended one,
    ended by `dynprof stop`). ``progress`` is told what the processes do meanwhile."""
    progress = progress or _Quiet()
    records = resolve(pids=request.pids, job=request.job)
    clients = [AgentClient.for_record(r, timeout=5.0) for r in records]
    statuses = _check(parallel(lambda c: c.status(), clients), records)
    steps = request.steps
    duration = request.duration
    messages: list[str] = []
    if not request.pids and not duration and len(records) > 1:
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
    at_step = request.at_step or 0
    group_id = uuid.uuid4().hex[:12]
    if request.sample_keep:
        group_id = SAMPLE_GROUP_PREFIX + group_id
        job = request.job or (records[0].job_id if records else None)
        if job:
            gone = prune_sample_traces(job, request.sample_keep - 1, set(request.keep_groups))
            if gone:
                messages.append(f"deleted {len(gone)} older straggler-sample trace(s) of job {job}")
    options = pb.TraceOptions(**TraceOptions.of(request).to_dict())
    lead = ALIGN_LEAD_S
    # Attached processes count steps from their attach: align them by boundary times.
    by_time = align and not request.at_step and any(r.activation == "attach" for r in records)
    for attempt in range(ALIGN_RETRIES):
        per_process = [at_step] * len(records)
        if align and not request.at_step:
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
                max_duration_s=request.max_duration,
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
        if passed and not request.at_step and attempt + 1 < ALIGN_RETRIES:
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
    if request.no_wait:
        targets = [target_row(r, started[r.pid].start_step) for r in records]
        return Started(
            exit_code=0,
            messages=messages,
            group_id=group_id,
            state="armed",
            at_step=at_step,
            targets=targets,
            requested=requested,
        )
    if not steps and not duration:
        got = _wait_active(request, clients, records, group_id, progress)
        sel = (
            f"--job {request.job}"
            if request.job
            else ("--all" if request.all else "--pid " + ",".join(str(r.pid) for r in records))
        )
        n_active = len(got.targets or [])
        active = (
            f"dynprof: tracing in {n_active} process(es); end it with `dynprof stop {sel}`"
            if n_active
            else "dynprof: the trace already ended: the process(es) exited while tracing"
        )
        got.exit_code = 0 if all(r["artifact"] and r["status"] != "failed" for r in got.results or []) else 1
        got.messages, got.requested, got.active = messages, requested, active
        return got
    results = _wait_done(request, clients, records, group_id, steps, at_step, progress)
    code = 0 if all(r["status"] == "complete" for r in results) else 1
    if code and all(r["status"] in ("complete", WRITING) for r in results):
        code = errors.Timeout.exit_code  # not failed: still being written when the wait ended
    return Started(exit_code=code, messages=messages, group_id=group_id, results=results, requested=requested)


def _wait_active(
    request: TraceRequest, clients: list[AgentClient], records: list[AgentRecord], group_id: str, progress: ProgressLine
) -> Started:
    """The trace once every process is tracing or has ended (``state``, ``targets``, and the
    traces already written, ``results``)."""
    deadline = time.monotonic() + (request.timeout or 120.0)
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
                else errors.AgentError(f"pid {record.pid}: the trace did not start: {s.last_error or 'unknown reason'}")
            )
        if len(active) + len(ended) == len(records):
            progress.done()
            return Started(
                group_id=group_id,
                state="tracing" if active else "ended",
                targets=[
                    target_row(r, s.start_step)
                    for (r, _), s in zip(pending, states)
                    if not isinstance(s, Exception) and s.state == "tracing"
                ],
                results=[ended[r.pid] for r in records if r.pid in ended] if ended else None,
            )
        if time.monotonic() > deadline:
            progress.done()
            raise errors.Timeout(
                f"the trace was not active after {request.timeout or 120:g} s",
                help="Check that the process is stepping (`dynprof ps`); the request stays armed until the hard cap.",
            )
        progress.update(f"waiting for the trace to start: {len(active)}/{len(records)} active")
        time.sleep(POLL_S)


def _wait_done(
    request: TraceRequest,
    clients: list[AgentClient],
    records: list[AgentRecord],
    group_id: str,
    steps: int,
    at_step: int,
    progress: ProgressLine,
) -> list[dict[str, Any]]:
    """Each process's trace once written (in ``records``' order)."""
    deadline = time.monotonic() + request.timeout if request.timeout else None
    results: dict[int, dict[str, Any]] = {}
    seen: dict[int, Any] = {}  # pid -> the last trace state its agent answered
    silent_since: dict[int, float] = {}  # pid -> since when its live process's agent has not answered
    try:
        while len(results) < len(records):
            pending = [(r, c) for r, c in zip(records, clients) if r.pid not in results]
            states = parallel(lambda rc: rc[1].status(), pending)
            parts = []
            for (record, _), st in zip(pending, states):
                label = f"rank {record.rank}" if record.rank is not None else f"pid {record.pid}"
                if isinstance(st, Exception) and _agent_busy(st, record.pid):
                    # The process runs and its agent does not answer: it is ending the trace
                    # and writing it (torch's writer holds the interpreter), not lost.
                    now = time.monotonic()
                    silent = now - silent_since.setdefault(record.pid, now)
                    bound = write_wait_s(seen.get(record.pid))
                    if silent > bound:
                        results[record.pid] = still_writing(record, at_step, silent, seen.get(record.pid))
                        continue
                    parts.append(
                        f"{label}: ending the trace: its agent is busy writing it "
                        f"(no answer for {silent:.0f} s; waiting up to {bound:.0f} s)"
                    )
                    continue
                if isinstance(st, Exception):
                    # The process is gone (it exited, or was killed): a trace it flushed on
                    # the way out is in the store under this request's group.
                    results[record.pid] = result_from_store(record, group_id, at_step) or {
                        **target_row(record, at_step),
                        "status": "failed",
                        "artifact": None,
                        "error": f"lost contact with the process before it wrote a trace "
                        f"({'it still runs' if _alive(record.pid) else 'it has exited'}): {st}",
                    }
                    continue
                silent_since.pop(record.pid, None)
                t = st.trace
                if t.group_id == group_id:
                    seen[record.pid] = t
                elif t.group_id:
                    # The agent answers for another request's trace: ours ended between two
                    # polls and another client's began (the agent keeps only the latest, and
                    # arms a new trace only once the last one is written). What ours left is in
                    # the store, under its group.
                    found = result_from_store(record, group_id, at_step)
                    if found is not None:
                        results[record.pid] = found
                        continue
                    results[record.pid] = {
                        **target_row(record, at_step),
                        "status": "failed",
                        "artifact": None,
                        "error": f"the process went on to another trace (group {printable(t.group_id)[:40]}) "
                        "and this one left no artifact; its agent log says why",
                    }
                    continue
                if t.group_id == group_id and t.state == "idle":
                    results[record.pid] = {
                        **target_row(record, t.start_step),
                        "status": t.last_artifact_status or "failed",
                        "artifact": t.last_artifact or None,
                        "error": t.last_error or None,
                    }
                    continue
                if t.state == "exporting" and t.ending_since:
                    parts.append(
                        f"{label}: writing the trace ({max(0.0, time.time() - t.ending_since):.0f} s; "
                        f"{t.profiled_s:.0f} s recorded)"
                    )
                elif t.state == "armed":
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
                    f"gave up waiting after {request.timeout:g} s; the trace continues and ends by itself",
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
    return [results[r.pid] for r in records]


def write_wait_s(last: Any) -> float:
    """How long a live process whose agent is silent is waited for, from the last trace state
    it answered (None: none yet): proportional to how long the trace recorded, which is what
    its write takes."""
    if last is None:
        return WRITE_WAIT_MIN_S
    if last.profiled_s:
        profiled = float(last.profiled_s)
    elif last.active_since:
        profiled = max(0.0, time.time() - float(last.active_since))
    else:
        profiled = 0.0
    return min(WRITE_WAIT_MAX_S, WRITE_WAIT_MIN_S + WRITE_WAIT_PER_PROFILED_S * profiled)


def still_writing(record: AgentRecord, at_step: int, silent: float, last: Any) -> dict[str, Any]:
    """A process's result when its agent stayed busy past :func:`write_wait_s` (``last``: the
    trace state it answered last): the trace is still being written, and where it will appear."""
    where = "`dynprof ls --kind trace" + (f" --job {shell_word(record.job_id)}`" if record.job_id else "`")
    if last is not None and last.state in ("tracing", "exporting"):
        note = (
            f"still being written: the process runs and its agent has been busy ending and writing the trace "
            f"for {silent:.0f} s (the write holds its interpreter); it will be listed by {where} once written"
        )
    else:
        note = (
            f"no answer from its agent for {silent:.0f} s while the process runs (its interpreter is held); "
            f"a trace it writes will be listed by {where}"
        )
    return {**target_row(record, at_step), "status": WRITING, "artifact": None, "error": None, "note": note}


def _agent_busy(exc: Exception, pid: int) -> bool:
    """``exc`` (from a status request) is an agent that does not answer in time, in a process
    that still runs: not one that is gone, refused or never was."""
    if isinstance(exc, (errors.NoAgent, errors.PermissionDenied)):
        return False
    return isinstance(exc, (errors.Timeout, errors.Busy)) and _alive(pid)


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    if not pid_alive(pid):
        return False
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
