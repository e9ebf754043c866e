"""Snapshots, allocator history and step plans of this node's processes: the memory kind's one
capture policy, whoever asks (``dynprof memory``, ``dynprof memory plan``, the sidecar's
``memory`` and ``memory-plan`` actions).

    >>> got = collect(MemoryRequest(job="j1"))                          # doctest: +SKIP
    >>> [r["artifact"] for r in got.results], got.exit_code             # doctest: +SKIP
    >>> planned = collect_plan(MemoryPlanRequest(pids=(42,), budget="60%"))   # doctest: +SKIP

Each process's agent answers: a snapshot is one ``memory`` artifact per process; history is
turned on (the next N allocator events) or off; a plan measures the next optimizer step in the
process and says which blocks to recompute to fit a budget, kept as a ``memory-plan`` artifact.
One row per process, whatever happened to it (``status``: ``ok``/``complete``, or ``failed``
with the error, its help and its exit code).

Not imported by ``collectors.memory`` itself: the agent, which imports that package, never
loads this policy.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from collectors.memory.plan import ranks as plan_ranks
from collectors.memory.plan.budget import parse_budget
from collectors.memory.plan.measurement import from_json as measurement_from_json
from collectors.memory.plan.render import KIND, PLAN_FILE
from collectors.memory.plan.scale import micro_batches
from collectors.memory.plan.solve import make_plan
from dynprof import errors
from dynprof.agents import parallel, resolve
from dynprof.arguments import MAX_HISTORY_EVENTS
from dynprof.client import AgentClient
from dynprof.proto import pb
from dynprof.registry import AgentRecord
from dynprof.requests import TARGETS, TargetedRequest, check_timeout, read_options
from dynprof.units import human_bytes

DEFAULT_TIMEOUT_S = 300.0
HISTORY_TIMEOUT_S = 30.0  # turning history on or off answers at once
STACKS = ("python", "all")
POLL_S = 0.2
MAX_MEASUREMENT_BYTES = 8 * 1024 * 1024
MICRO_BATCH_MAX_BLOCKS = 512  # the micro-batch sizes plan a dozen times: only up to this many blocks


@dataclass(frozen=True)
class MemoryRequest(TargetedRequest):
    """Whose memory: exactly one of ``pids``, ``job`` (its trainers on this node) or ``all``.
    What: a snapshot (the default, each waited for ``timeout`` seconds), or history turned on
    for the next ``history_start`` allocator events (with ``stacks`` python or all), or turned
    off (``history_stop``). Checked when made: a bad request raises
    :class:`~dynprof.errors.UsageError`."""

    history_start: int | None = None
    history_stop: bool = False
    stacks: str = "python"
    timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        self.check_one_target("memory")
        self.check_pids()
        if self.history_start is not None and self.history_stop:
            raise errors.UsageError("give --history-start or --history-stop, not both")
        if self.history_start is not None and not 0 < self.history_start <= MAX_HISTORY_EVENTS:
            raise errors.UsageError(
                f"--history-start N needs 1 <= N <= {MAX_HISTORY_EVENTS}", help="Use --history-stop to stop."
            )
        if self.stacks not in STACKS:
            raise errors.UsageError(f"--stacks {self.stacks[:40]!a}: one of {', '.join(STACKS)}")
        check_timeout(self.timeout)

    @property
    def history(self) -> bool:
        return self.history_start is not None or self.history_stop

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "history_start": "int",
        "history_stop": "bool",
        "stacks": "str",
        "timeout": "float",
    }

    @classmethod
    def from_json(cls, doc: Any) -> MemoryRequest:
        """The request of a JSON object of the ``memory`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "memory")
        return cls(
            **cls.targets_of(o),
            history_start=o.get("history_start"),
            history_stop=o.get("history_stop", False),
            stacks=o.get("stacks", "python"),
            timeout=o.get("timeout", DEFAULT_TIMEOUT_S),
        )

    def to_json(self) -> dict[str, Any]:
        out = {**self.targets_json(), "timeout": self.timeout}
        if self.history_start is not None:
            out["history_start"] = self.history_start
        if self.history_stop:
            out["history_stop"] = True
        if self.stacks != "python":
            out["stacks"] = self.stacks
        return out


@dataclass
class Collected:
    """One row per process (``results``), the exit code they mean (0: every one answered;
    else the failures' common code, or 1), the errors of the processes that failed
    (``failures``, in order) and what is worth saying besides (``notes``)."""

    results: list[dict[str, Any]]
    exit_code: int
    failures: list[errors.DynprofError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)  # plans: one per group of a job's ranks that agree


def _failed_row(res: dict[str, Any], exc: errors.DynprofError) -> None:
    res.update(status="failed", error=exc.message, help=exc.help, exit_code=exc.exit_code)


def _exit_code(results: list[dict[str, Any]], ok: tuple[str, ...]) -> int:
    failed = [r for r in results if r["status"] not in ok]
    if not failed:
        return 0
    codes = {r.get("exit_code", 1) for r in failed}
    return codes.pop() if len(codes) == 1 else 1


def collect(request: MemoryRequest) -> Collected:
    """A snapshot of each process ``request`` names, or its history turned on or off."""
    records = resolve(pids=request.pids, job=request.job)
    if request.history:
        message: Any = pb.MemoryHistoryRequest(
            enable=not request.history_stop, max_entries=request.history_start or 0, stacks=request.stacks
        )
        command, timeout = "memory_history", HISTORY_TIMEOUT_S
    else:
        message, command, timeout = pb.MemorySnapshotRequest(), "memory_snapshot", request.timeout

    def ask(record: AgentRecord) -> Any:
        return AgentClient.for_record(record, timeout=timeout).request(**{command: message})

    replies = parallel(ask, records)
    results: list[dict[str, Any]] = []
    failures: list[errors.DynprofError] = []
    for record, reply in zip(records, replies):
        res: dict[str, Any] = {"pid": record.pid, "rank": record.rank, "job": record.job_id}
        if isinstance(reply, errors.DynprofError):
            _failed_row(res, reply)
            failures.append(reply)
        elif isinstance(reply, Exception):
            raise reply
        elif request.history:
            res.update(status="ok", memory_history=reply.ack.detail)
        else:
            res.update(
                status=reply.artifact.status,
                artifact=reply.artifact.path,
                summary=json.loads(reply.artifact.summary_json or "{}"),
            )
        results.append(res)
    return Collected(results, _exit_code(results, ("ok", "complete")), failures)


# -- plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlanRequest(TargetedRequest):
    """Whose next optimizer step to measure: exactly one of ``pids``, ``job`` or ``all``; what
    to plan for: exactly one of ``budget`` (the peak the step must fit in: ``40G``, or ``60%`` of
    the measured peak) or ``save`` (the bytes to take off the peak); how long to wait for the
    step (``timeout``). Checked when made: a bad request raises
    :class:`~dynprof.errors.UsageError`."""

    budget: str | None = None
    save: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    undo: bool = False  # take back what `dynprof run --checkpoint` applied, instead of a plan

    def __post_init__(self) -> None:
        self.check_one_target("memory")
        self.check_pids()
        if self.undo:
            if self.budget is not None or self.save is not None:
                raise errors.UsageError("--undo takes no --budget or --save")
            check_timeout(self.timeout)
            return
        if self.budget is None and self.save is None:
            raise errors.UsageError(
                "dynprof memory plan needs --budget SIZE or --save SIZE",
                help="Say what the step's peak must fit in (--budget 40G, --budget 60%) or how much to save "
                "(--save 8G).",
            )
        if self.budget is not None and self.save is not None:
            raise errors.UsageError("give --budget or --save, not both")
        parse_budget(self.budget if self.budget is not None else self.save or "")
        check_timeout(self.timeout)

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "budget": "str",
        "save": "str",
        "timeout": "float",
        "undo": "bool",
    }

    @classmethod
    def from_json(cls, doc: Any) -> MemoryPlanRequest:
        """The request of a JSON object of the ``memory-plan`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "memory-plan")
        return cls(
            **cls.targets_of(o),
            budget=o.get("budget"),
            save=o.get("save"),
            timeout=o.get("timeout", DEFAULT_TIMEOUT_S),
            undo=o.get("undo", False),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.targets_json(), "timeout": self.timeout}
        if self.undo:
            out["undo"] = True
        if self.budget is not None:
            out["budget"] = self.budget
        if self.save is not None:
            out["save"] = self.save
        return out

    def asked_bytes(self, measurement: dict[str, Any]) -> dict[str, int]:
        """The budget or the saving asked for, in bytes of this measurement: ``{"budget_bytes": N}``
        or ``{"save_bytes": N}`` (a percentage is of the measured peak)."""
        m = measurement_from_json(measurement)
        if self.budget is not None:
            size, fraction = parse_budget(self.budget)
            return {"budget_bytes": size if size is not None else int(m.peak_bytes * (fraction or 0))}
        size, fraction = parse_budget(self.save or "")
        if size is not None and size > m.peak_bytes:
            raise errors.UsageError(
                f"--save {(self.save or '')[:80]!r} is more than the measured step's peak ({human_bytes(m.peak_bytes)}): "
                "no plan saves more than the whole peak",
                help="Ask for less than the peak (--save 8G, --save 30%), or say what the step must fit in "
                "(--budget 40G).",
            )
        return {"save_bytes": size if size is not None else int(m.peak_bytes * (fraction or 0))}

    def plan(self, measurement: dict[str, Any]) -> dict[str, Any]:
        """The plan of ``measurement`` for what this request asks."""
        m = measurement_from_json(measurement)
        asked = self.asked_bytes(measurement)
        if "budget_bytes" in asked:
            plan = make_plan(m, budget=asked["budget_bytes"])
        else:
            plan = make_plan(m, save=asked["save_bytes"])
        if len(m.blocks) <= MICRO_BATCH_MAX_BLOCKS:
            # which micro-batch fits the same budget, scaled from this step's tokens
            plan["micro_batches"] = micro_batches(measurement, int(plan["budget_bytes"]))
        return plan


def save_plan(record: AgentRecord, measurement: dict[str, Any], request: MemoryPlanRequest) -> str:
    """Keep the measurement and what was asked as a ``memory-plan`` artifact; its path."""
    from dynprof.store import ArtifactStore

    asked = request.asked_bytes(measurement)
    writer = ArtifactStore().create(
        KIND,
        job=record.job_id,
        host=record.host or None,
        rank=record.rank,
        pid=record.pid,
        options={"budget": request.budget, "save": request.save},
    )
    with writer:
        writer.write_json(PLAN_FILE, {"schema": 1, "measurement": measurement, "asked": asked})
        return str(writer.finish("complete", summary=asked).path)


def _answer(record: AgentRecord, text: str, short: str, what: str, max_values: int) -> dict[str, Any]:
    """An agent's JSON answer (a measurement, a checkpoint state), read bounded: at most
    ``MAX_MEASUREMENT_BYTES`` and ``max_values`` values, a JSON object. Raises
    :class:`~dynprof.errors.ArtifactError` naming the process."""
    from dynprof.untrusted import loads_json

    text = text or "{}"
    if len(text) > MAX_MEASUREMENT_BYTES:
        raise errors.ArtifactError(f"pid {record.pid}: the {short} is over {MAX_MEASUREMENT_BYTES} bytes")
    doc = loads_json(text, f"pid {record.pid}'s {what}", max_values=max_values)
    if not isinstance(doc, dict):
        raise errors.ArtifactError(f"pid {record.pid}: the {short} is not a JSON object")
    return doc


def collect_plan(request: MemoryPlanRequest) -> Collected:
    """Measure the next step of each process ``request`` names and plan it; each plan kept as an
    artifact (a plan that could not be kept is a note, its row still ``ok``). The ranks of a
    job whose measurements agree get one plan besides (``jobs``: :func:`job_plans`)."""
    if request.undo:
        return collect_undo(request)
    records = resolve(pids=request.pids, job=request.job)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    deadline = time.monotonic() + request.timeout

    def ask(record: AgentRecord) -> Any:
        client = AgentClient.for_record(record, timeout=10.0)
        while True:
            reply = client.request(memory_plan=pb.MemoryPlanRequest(token=token))
            state = reply.artifact.status
            if state in ("complete", "failed"):
                return reply.artifact
            if time.monotonic() > deadline:
                raise errors.Timeout(
                    f"pid {record.pid}: no training step within {request.timeout:g} s (state: {state})",
                    help="The job must be stepping its optimizer; raise --timeout for long steps. The "
                    "measurement is dropped by the agent if its step does not come.",
                )
            time.sleep(POLL_S)

    replies = parallel(ask, records)
    results: list[dict[str, Any]] = []
    failures: list[errors.DynprofError] = []
    save_errors: list[str] = []
    measured: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (row, measurement) of each plan
    for record, reply in zip(records, replies):
        res: dict[str, Any] = {"pid": record.pid, "rank": record.rank, "job": record.job_id}
        if isinstance(reply, errors.DynprofError):
            _failed_row(res, reply)
            failures.append(reply)
        elif isinstance(reply, Exception):
            raise reply
        else:
            try:
                doc = _answer(record, reply.summary_json, "measurement", "memory plan measurement", 1_000_000)
                plan = request.plan(doc) if reply.status == "complete" else None
            except errors.ArtifactError as exc:
                _failed_row(res, exc)
                failures.append(exc)
                results.append(res)
                continue
            if reply.status != "complete":
                err = errors.AgentError(
                    f"pid {record.pid}: the measurement failed: {str(doc.get('error', '?'))[:500]}",
                    help="See the agent log in the dynprof runtime directory (logs/PID.log).",
                )
                _failed_row(res, err)
                failures.append(err)
            else:
                res.update(status="ok", plan=plan)
                measured.append((res, doc))
                try:
                    res["artifact"] = save_plan(record, doc, request)
                except (OSError, errors.DynprofError) as exc:
                    res["artifact"] = None
                    save_errors.append(f"pid {record.pid}: the plan was not saved: {exc}")
        results.append(res)
    jobs = job_plans(request, measured, save_errors)
    return Collected(results, _exit_code(results, ("ok",)), failures, save_errors, jobs)


def job_plans(
    request: MemoryPlanRequest, measured: list[tuple[dict[str, Any], dict[str, Any]]], notes: list[str]
) -> list[dict[str, Any]]:
    """One plan per group of a job's ranks whose measurements agree
    (:mod:`collectors.memory.plan.ranks`), for each job of two measured ranks or more: the
    group's ranks and pids, the plan of their merged measurement (the highest peak's bytes, the
    slowest rank's times), each rank's own figures, and for a group after the job's first, the
    ranks it differs from and how. A group that cannot be planned is a note."""
    by_job: dict[str, list[plan_ranks.Member]] = {}
    for row, doc in measured:
        if row.get("job"):
            try:
                by_job.setdefault(str(row["job"]), []).append(plan_ranks.member(row, doc))
            except errors.ArtifactError as exc:
                notes.append(f"pid {row['pid']}: left out of its job's plan: {exc.message}")
    out: list[dict[str, Any]] = []
    for job, members in by_job.items():
        if len(members) < 2:
            continue
        for g in plan_ranks.group(job, members):
            doc, highest, slowest = plan_ranks.merged(g)
            try:
                plan = request.plan(doc)
            except errors.ArtifactError as exc:
                notes.append(f"job {job}, {plan_ranks.ranks_text(g.ranks)}: not planned: {exc.message}")
                continue
            modules = list((plan.get("plan") or {}).get("modules") or [])
            out.append(
                {
                    "job": job,
                    "ranks": g.ranks,
                    "pids": [m.pid for m in g.members],
                    "tolerance": plan_ranks.TOLERANCE,
                    "bytes_of": {"rank": highest.rank, "pid": highest.pid},
                    "times_of": {"rank": slowest.rank, "pid": slowest.pid},
                    "differs_from": g.differs_from,
                    "how": g.how,
                    "plan": plan,
                    "rank_figures": plan_ranks.rank_figures(g, modules),
                }
            )
    return out


def collect_undo(request: MemoryPlanRequest) -> Collected:
    """Take back, in each process ``request`` names, the blocks ``dynprof run --checkpoint``
    wrapped: the agent does it at the job's next step boundary, on its training thread; this
    waits for it (at most ``request.timeout``). A row's ``undo`` is ``undone`` or ``nothing``
    (nothing was wrapped), its ``checkpoint`` the agent's state after."""
    records = resolve(pids=request.pids, job=request.job)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    deadline = time.monotonic() + request.timeout

    def ask(record: AgentRecord) -> Any:
        client = AgentClient.for_record(record, timeout=10.0)
        while True:
            reply = client.request(memory_plan=pb.MemoryPlanRequest(token=token, undo=True))
            if reply.artifact.status in ("undone", "nothing"):
                return reply.artifact
            if time.monotonic() > deadline:
                raise errors.Timeout(
                    f"pid {record.pid}: no step boundary within {request.timeout:g} s to take the checkpointing back",
                    help="The agent takes it back at the job's next optimizer step; it still will.",
                )
            time.sleep(POLL_S)

    results: list[dict[str, Any]] = []
    failures: list[errors.DynprofError] = []
    for record, reply in zip(records, parallel(ask, records)):
        res: dict[str, Any] = {"pid": record.pid, "rank": record.rank, "job": record.job_id}
        if isinstance(reply, errors.DynprofError):
            _failed_row(res, reply)
            failures.append(reply)
        elif isinstance(reply, Exception):
            raise reply
        else:
            try:
                state = _answer(record, reply.summary_json, "checkpoint state", "checkpoint state", 100_000)
            except errors.ArtifactError as exc:
                _failed_row(res, exc)
                failures.append(exc)
                results.append(res)
                continue
            res.update(status="ok", undo=reply.status, checkpoint=state if isinstance(state, dict) else None)
        results.append(res)
    return Collected(results, _exit_code(results, ("ok",)), failures)
