"""On-demand torch.profiler traces: the agent's side of ``dynprof start`` / ``dynprof stop``.

States: ``idle`` -> ``armed`` (waiting for the start step) -> ``tracing`` -> ``exporting`` ->
``idle``. The profiler is started, stepped and stopped on the training thread: at optimizer
step boundaries (step mode), or through the main thread's pending-call queue when there are
no steps to align to (duration mode, or a process that never steps an optimizer). Export runs
on a background thread. A trace always ends by itself: after its steps or duration, or at the
hard cap, whether or not the CLI that asked for it is still there. Writing the trace, and what
the job's exit does with one, are ``_trace_write``'s (the controller's other half).

The profiler is started and stopped only at a safe point (see ``_safety``): never inside
autograd's backward, a torch.compile region, or while the job's own profiler records. A step
boundary or pending call that lands somewhere unsafe is retried a few milliseconds later; a
job that starts its own profiler during a dynprof trace ends that trace first (``partial``,
stopped by ``job-profiler``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from collectors.torch_trace import WRITING_AT_EXIT, TraceOptions, TraceSession
from dynprof.agent._mainthread import call_soon_in_main_thread
from dynprof.agent._safety import WATCH, UnsafeReason, in_optimizer_step, other_profiler_active, unsafe_reason
from dynprof.agent._server import CommandError
from dynprof.agent._trace_write import TraceExport, TraceWriting
from dynprof.proto import pb

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

MAX_DURATION_LIMIT_S = 7 * 24 * 3600.0  # no duration or cap beyond a week is accepted
MAX_STEPS = 1_000_000
MAX_AT_STEP = 2**62
# A start or stop that lands somewhere unsafe is retried this often (main thread only).
SAFE_POINT_RETRY_S = 0.005
# A duration-mode trace of a loop whose steps take at most this long starts and ends at step
# boundaries (each span then one iteration); with longer steps it starts at once (the request
# is served within ~100 ms) and the manifest marks its first span partial.
ALIGN_DURATION_MAX_STEP_S = 0.1
# A stop due while steps flow waits for the next step boundary, at most this many step times
# (and at least STOP_GRACE_MIN_S); then it ends where the main thread is (last span partial).
STOP_GRACE_STEPS = 3.0
STOP_GRACE_MIN_S = 0.5
MAX_SPANS_DESCRIBED = 10_000
MAX_OPTIMIZER_WAITS = 200


def _default_max_duration() -> float:
    text = os.environ.get("DYNPROF_TRACE_MAX_S", "").strip()
    try:
        value = float(text) if text else 600.0
    except ValueError:
        value = 600.0
    if not (math.isfinite(value) and 0 < value <= MAX_DURATION_LIMIT_S):
        log.warning("DYNPROF_TRACE_MAX_S=%r is not a duration in (0, %g] s; using 600", text, MAX_DURATION_LIMIT_S)
        value = 600.0
    return value


DEFAULT_MAX_DURATION_S = _default_max_duration()


class TraceController(TraceWriting):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.steps = agent.steps
        self._lock = threading.RLock()
        self.state = "idle"
        self.req: Any = None  # the StartTraceRequest being served
        self.start_step = 0
        self.steps_done = 0
        self.session: TraceSession | None = None
        self.stop_requested: str | None = None  # why: "request", "duration", "cap"
        self.last_artifact = ""
        self.last_status = ""
        self.last_error = ""
        self.last_group = ""
        self._timers: list[threading.Timer] = []
        self._export_thread: threading.Thread | None = None
        self._export_job: TraceExport | None = None  # the trace being written
        self._exiting = False  # the job's exit hook runs
        self._stop_deferred = False
        self._deferred_reason: UnsafeReason | None = None  # why the pending start or stop waits (logged once)
        # True while this controller starts or stops the profiler. The lock is re-entrant, and
        # torch runs Python inside start/stop, where CPython may run a pending call of ours on
        # the same thread: such a nested entry must not start or stop a second time.
        self._transitioning = False
        # What the spans of the trace in progress are (see _span_fields).
        self._aligned = False  # started at a step boundary, listening to boundaries
        self._first_partial = False
        self._partial_why = ""  # why the first span does not start at a step boundary
        self._last_partial = False
        self._last_partial_why = ""  # why the last span does not end at a step boundary
        self._span_marks: list[int] = []  # StepTracker.all_optimizer_steps() at each span boundary
        self._spans_omitted = 0  # spans past the first MAX_SPANS_DESCRIBED, counted, not described
        self._inexact_at_start = 0  # StepTracker.inexact_boundaries when the trace started
        self._stop_wait_why = ""  # why the stop due at a step boundary waited for a safe point
        self._optimizer_waits = 0
        WATCH.on_foreign_prepare = self._on_foreign_profiler

    # -- protocol handlers (server thread) -------------------------------------------------
    def handle_start(self, msg: Any) -> tuple[str, Any]:
        if msg.steps and msg.duration_s:
            raise CommandError(pb.INVALID_ARGUMENT, "give --steps or --duration, not both")
        for name, value in (("duration", msg.duration_s), ("max duration", msg.max_duration_s)):
            if not (math.isfinite(value) and 0 <= value <= MAX_DURATION_LIMIT_S):
                raise CommandError(
                    pb.INVALID_ARGUMENT, f"{name} {value!r} s is out of range (0 .. {MAX_DURATION_LIMIT_S:g} s)"
                )
        if msg.steps > MAX_STEPS or msg.at_step > MAX_AT_STEP:
            raise CommandError(pb.INVALID_ARGUMENT, f"steps must be at most {MAX_STEPS} and at_step at most 2**62")
        if "torch" not in sys.modules:
            raise CommandError(
                pb.NO_TORCH,
                "torch is not imported in this process",
                "dynprof traces PyTorch code: the target must import torch (a launcher such as "
                "torchrun's parent process does not; trace its workers, see `dynprof ps`).",
            )
        try:
            import torch.profiler  # noqa: F401
        except Exception as exc:
            raise CommandError(pb.UNSUPPORTED, f"torch.profiler is unavailable: {exc}") from None
        WATCH.install()  # normally in place since torch was imported; a no-op then
        with self._lock:
            if self.state != "idle":
                raise CommandError(
                    pb.BUSY,
                    f"a trace is already {self.state} (group {self.last_group or '-'})",
                    f"Wait for it to finish, or end it with `dynprof stop --pid {os.getpid()}`.",
                )
            if other_profiler_active():
                raise _profiler_active_error()
            planner = getattr(getattr(self.agent, "memory", None), "planner", None)
            measuring = planner.measuring() if planner is not None else ""
            if measuring:
                raise CommandError(
                    pb.BUSY,
                    f"a memory plan measurement is {measuring} in this process: it runs every operator of its "
                    "step through Python (a dispatch mode), so a trace of that step would show each operator twice "
                    "and its time as the job's",
                    "Start the trace once the measurement has ended (one training step): ask again.",
                )
            self.steps.fold_compiled()
            now_step = self.steps.step
            flowing = self._steps_flowing()
            step_aligned = (
                msg.steps > 0
                or (msg.duration_s == 0 and flowing)
                or (flowing and self.steps.typical_step_s() <= ALIGN_DURATION_MAX_STEP_S)
            )
            if msg.steps > 0 and not self.steps.hook_installed:
                raise CommandError(
                    pb.UNSUPPORTED,
                    "no optimizer step hook in this process (torch.optim not imported yet)",
                    "Use --duration SEC for processes without optimizer steps.",
                )
            if msg.at_step and msg.at_step <= now_step:
                raise CommandError(pb.STEP_PASSED, f"step {msg.at_step} has passed (the process is at step {now_step})")
            self.req = msg
            self.start_step = msg.at_step or (now_step + 1 if step_aligned else 0)
            self.steps_done = 0
            self.stop_requested = None
            self.last_group = msg.group_id
            self.last_error = ""
            self.last_artifact = ""  # the state reports this request's artifact, never an older one
            self.last_status = ""
            self._aligned = step_aligned
            self._first_partial = self._last_partial = False
            self._last_partial_why = ""
            self._partial_why = self._unaligned_why(msg, flowing) if not step_aligned else ""
            self._span_marks = []
            self._spans_omitted = 0
            self.state = "armed"
            max_s = msg.max_duration_s or DEFAULT_MAX_DURATION_S
            if msg.duration_s:
                max_s = max(max_s, msg.duration_s * 2 + 10)
            self._timer(max_s, self._on_cap)
            if step_aligned:
                self.steps.add_listener(self._on_boundary)
            elif not call_soon_in_main_thread(self._start_at_safe_point):
                self._reset_to_idle("the main thread's pending-call queue is full")
                raise CommandError(pb.INTERNAL, "could not reach the main thread; try again")
            log.info(
                "trace armed: steps=%d duration=%.3f start_step=%d group=%s",
                msg.steps,
                msg.duration_s,
                self.start_step,
                msg.group_id,
            )
            return "trace_started", pb.TraceStarted(trace=self.state_pb())

    def handle_stop(self, msg: Any) -> tuple[str, Any]:
        with self._lock:
            if self.state == "armed":
                self._reset_to_idle("cancelled by dynprof stop before it started")
                return "trace_stopped", pb.TraceStopped(trace=self.state_pb())
            if self.state == "exporting":
                # Already stopped and being written (at the job's exit, too): the reply says so
                # (and, at exit, where it will be), and the CLI waits for the artifact.
                return "trace_stopped", pb.TraceStopped(trace=self.state_pb())
            if self.state != "tracing":
                raise CommandError(pb.NOT_RUNNING, "no trace is running")
            self._request_stop("request")
            return "trace_stopped", pb.TraceStopped(trace=self.state_pb())

    def state_pb(self) -> Any:
        req = self.req
        session = self.session
        artifact, status = self.last_artifact, self.last_status
        export = self._export_job
        if self.state == "exporting" and self._exiting:
            # The job is exiting while this trace is written: where it will be, once known.
            writer = export.writer if export is not None else None
            artifact = str(writer.final_path) if writer is not None else ""
            status = WRITING_AT_EXIT
        # While the trace is written: since when, and how long it recorded (what the write's
        # length goes with), so a client can tell a trace being written from a lost agent.
        ending_since = profiled_s = 0.0
        if self.state == "exporting" and session is not None and session.stopped_at > 0:
            ending_since = session.stopped_at
            profiled_s = max(0.0, session.stopped_at - session.started_at)
        return pb.TraceState(
            ending_since=ending_since,
            profiled_s=profiled_s,
            state=self.state,
            start_step=self.start_step,
            steps=req.steps if req is not None else 0,
            steps_done=self.steps_done,
            active_since=session.started_at if session is not None and self.state == "tracing" else 0.0,
            last_artifact=artifact,
            last_error=self.last_error,
            group_id=self.last_group,
            last_artifact_status=status,
        )

    # -- helpers -----------------------------------------------------------------------------
    def _unaligned_why(self, msg: Any, flowing: bool) -> str:
        """Why a trace of this request starts where the main thread is, not at a step boundary."""
        s = self.steps
        if not s.hook_installed:
            return "no optimizer step hook in this process"
        if not flowing:
            return "no optimizer step in the last few seconds"
        return (
            f"steps took {s.typical_step_s():.3f} s when it was asked for, over the "
            f"{ALIGN_DURATION_MAX_STEP_S:g} s that a --duration trace waits for a boundary"
        )

    def _steps_flowing(self) -> bool:
        s = self.steps
        if not s.hook_installed or not s.last_step_at:
            return False
        window = max(2.0, 5 * s.step_time_s)
        return time.time() - s.last_step_at < window

    def _timer(self, seconds: float, fn: Any) -> None:
        self._timers = [t for t in self._timers if t.is_alive()]
        t = threading.Timer(seconds, fn)
        t.daemon = True
        t.name = "dynprof-trace-timer"
        t.start()
        self._timers.append(t)

    def _cancel_timers(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers.clear()

    def _reset_to_idle(self, error: str = "") -> None:
        self._cancel_timers()
        self._stop_deferred = False
        self.steps.remove_listener(self._on_boundary)
        self.state = "idle"
        self.session = None
        self.stop_requested = None
        if error:
            self.last_error = error
            self.last_status = "failed"
            log.warning("trace: %s", error)

    def _distributed_info(self) -> dict[str, Any]:
        ident = self.agent.identity
        return {
            "backend": "none",
            "rank": ident.rank if ident.rank is not None else 0,
            "world_size": ident.world_size if ident.world_size is not None else 1,
            "local_rank": ident.local_rank if ident.local_rank is not None else 0,
        }

    def _options(self) -> TraceOptions:
        return TraceOptions.of(self.req.options)

    # -- training-thread side ---------------------------------------------------------------
    def _begin(self, first_step: int | None) -> bool:
        """Start the profiler on the calling thread, at a safe point. Caller holds the lock.

        Returns False (and changes nothing) when this moment is not safe; the caller retries.
        """
        if self._transitioning:
            return False
        self._transitioning = True
        try:
            return self._begin_unguarded(first_step)
        finally:
            self._transitioning = False

    def _begin_unguarded(self, first_step: int | None) -> bool:
        reason = unsafe_reason()
        if self.state != "armed":
            return True  # something ran meanwhile (on this thread) and took the request on
        if reason is not None:
            if reason is UnsafeReason.OTHER_PROFILER:
                self._reset_to_idle(_profiler_active_error().message)
                return True
            if reason is not self._deferred_reason:
                log.info("trace start waits for a safe point: %s", reason.text)
                self._deferred_reason = reason
            return False
        self._deferred_reason = None
        session = TraceSession(self._options(), self._distributed_info())
        try:
            with WATCH.ours():
                session.start(first_step)
        except Exception as exc:
            log.exception("starting the profiler failed")
            self._reset_to_idle(f"starting torch.profiler failed: {type(exc).__name__}: {exc}")
            return True
        self.session = session
        self.state = "tracing"
        self._span_marks = [self.steps.all_optimizer_steps()]
        self._spans_omitted = 0
        self._inexact_at_start = self.steps.inexact_boundaries
        self._stop_wait_why = ""
        req = self.req
        if req.duration_s:
            self._timer(req.duration_s, lambda: self._request_stop_locked("duration"))
        log.info("trace started at step %d", self.steps.step)
        return True

    def _on_boundary(self, step: int) -> None:
        with self._lock:
            if self._transitioning:
                return
            if self.state == "armed":
                if step < self.start_step:
                    return
                if self._begin(first_step=step + 1):
                    self._first_partial = False  # it starts at this boundary
                else:
                    self._first_partial = True  # it starts later, where the main thread is
                    why = self._deferred_reason.text if self._deferred_reason is not None else "a start under way"
                    self._partial_why = f"step {step}'s boundary was not a safe point to start ({why})"
                    if self._aligned:  # an unaligned start retries on the main thread already
                        self._retry_on_main_thread(self._start_at_safe_point)
                return
            if self.state != "tracing" or self.session is None:
                return
            if threading.get_ident() != self.session.thread_id:
                return
            self.steps_done += 1
            self._mark_span()
            req = self.req
            if self.stop_requested or (req.steps and self.steps_done >= req.steps):
                why = self.stop_requested or "steps"
                self._last_partial = False
                if self._end_at_safe_point(why):
                    return  # the last span ends at this boundary
                if not self._stop_wait_why and self._deferred_reason is not None:
                    self._stop_wait_why = (
                        f"step {step}'s boundary was not a safe point to stop ({self._deferred_reason.text})"
                    )
                self.stop_requested = why
                if not self._stop_deferred:
                    self._stop_deferred = True
                    self._retry_on_main_thread(self._stop_at_safe_point)
            # A new span (also while a stop waits for a safe point: spans stay one iteration).
            self.session.step()

    def _retry_on_main_thread(self, fn: Any) -> None:
        """Run ``fn`` on the main thread soon, through the pending-call queue.

        When the training thread is not the main thread, the next step boundary retries.
        """
        session_thread = self.session.thread_id if self.session is not None else self.steps.hook_thread_id
        if session_thread is not None and session_thread != threading.main_thread().ident:
            return

        def queue() -> None:
            if not call_soon_in_main_thread(fn):
                log.warning("trace: the main thread's pending-call queue is full; retrying")
                self._timer(SAFE_POINT_RETRY_S * 10, queue)

        self._timer(SAFE_POINT_RETRY_S, queue)

    def _start_at_safe_point(self) -> None:
        """On the main thread: start an armed trace whose start is due (duration mode, or a
        step-mode start that landed somewhere unsafe)."""
        with self._lock:
            if self._transitioning:
                self._retry_on_main_thread(self._start_at_safe_point)
                return
            if self.state != "armed":
                return
            due = self.start_step == 0 or self.steps.step >= self.start_step
            if not due:
                return
            first = self.steps.step + 1 if self.steps.hook_installed else None
            self._first_partial = self.steps.hook_installed  # not at a step boundary
            if self._inside_optimizer_step() or not self._begin(first_step=first):
                self._retry_on_main_thread(self._start_at_safe_point)
                if self.steps.hook_installed:
                    # The next step boundary is a safe point too: a job whose backward runs
                    # Python (activation checkpointing) may take every pending call inside it.
                    self.steps.add_listener(self._on_boundary)
                return
            if self.state == "tracing" and self.steps.hook_installed:
                self.steps.add_listener(self._on_boundary)

    def _inside_optimizer_step(self) -> bool:
        """A pending-call start or stop waits out the optimizer step it landed in, for up to
        MAX_OPTIMIZER_WAITS retries (a loop that runs whole iterations inside the optimizer's
        step, with a closure, is then started or stopped where it is)."""
        if self._optimizer_waits >= MAX_OPTIMIZER_WAITS or not in_optimizer_step(skip=3):
            self._optimizer_waits = 0
            return False
        self._optimizer_waits += 1
        return True

    def _stop_at_safe_point(self) -> None:
        with self._lock:
            if self._transitioning:
                self._retry_on_main_thread(self._stop_at_safe_point)
                return
            if self.state != "tracing" or self.session is None or not self.stop_requested:
                return
            if self.session.thread_id != threading.get_ident():
                return
            self._last_partial = True  # not at a step boundary
            if self._inside_optimizer_step() or not self._end_at_safe_point(self.stop_requested):
                self._stop_deferred = True
                self._retry_on_main_thread(self._stop_at_safe_point)

    def _end_at_safe_point(self, why: str) -> bool:
        reason = unsafe_reason(check_other_profiler=False)
        if reason is not None:
            if reason is not self._deferred_reason:
                log.info("trace stop waits for a safe point: %s", reason.text)
                self._deferred_reason = reason
            return False
        self._deferred_reason = None
        self._end(why)
        return True

    def _request_stop_locked(self, why: str) -> None:
        with self._lock:
            self._request_stop(why)

    def _request_stop(self, why: str) -> None:
        if self.state != "tracing" or self.session is None:
            return
        if self.stop_requested is None:
            self.stop_requested = why
            if self.session.stop_requested_at == 0.0:
                self.session.stop_requested_at = time.time()
        if self._aligned and self._steps_flowing():
            # The next step boundary ends it (the last span one whole iteration); if none
            # comes soon, the main thread does.
            grace = max(STOP_GRACE_MIN_S, STOP_GRACE_STEPS * self.steps.typical_step_s())
            self._last_partial_why = (
                f"no step boundary came within {grace:.2g} s of the stop (3 typical steps, at least "
                f"{STOP_GRACE_MIN_S:g} s): it ends where the training thread was"
            )
            self._timer(grace, self._stop_without_boundary)
            return
        self._last_partial_why = (
            "the steps had stopped when the stop came: it ends where the training thread was"
            if self._aligned
            else "the trace did not start at a step boundary, so it ends where the training thread is"
        )
        if self.session.thread_id == threading.main_thread().ident:
            call_soon_in_main_thread(self._stop_at_safe_point)
        # Otherwise the next step boundary on the tracing thread ends it.

    def _stop_without_boundary(self) -> None:
        with self._lock:
            if self.state != "tracing" or self.session is None or not self.stop_requested:
                return
            if self.session.thread_id == threading.main_thread().ident:
                call_soon_in_main_thread(self._stop_at_safe_point)

    def _mark_span(self) -> None:
        if len(self._span_marks) <= MAX_SPANS_DESCRIBED:
            self._span_marks.append(self.steps.all_optimizer_steps())
        else:
            self._spans_omitted += 1

    def _span_fields(self, at_boundary: bool) -> dict[str, Any]:
        """What the trace's ProfilerStep# spans are, for the manifest: the optimizer steps of
        each of the first MAX_SPANS_DESCRIBED spans, and how many spans follow undescribed."""
        marks = self._span_marks
        omitted = self._spans_omitted
        if not at_boundary and marks:
            if len(marks) <= MAX_SPANS_DESCRIBED:
                marks = [*marks, self.steps.all_optimizer_steps()]  # the last span, up to the stop
            else:
                omitted += 1
        per_span = [b - a for a, b in itertools.pairwise(marks)]
        inexact = max(0, self.steps.inexact_boundaries - self._inexact_at_start)
        return {
            "span": "iteration",  # ProfilerStep#N: training iteration N, boundary to boundary
            "first_span_partial": self._first_partial,
            "first_span_partial_why": self._partial_why if self._first_partial else "",
            "last_span_partial": not at_boundary,
            "last_span_partial_why": ""
            if at_boundary
            else (self._last_partial_why or "it ended where the training thread was"),
            "optimizer_steps_per_span": per_span,
            "optimizer_steps_per_span_omitted": omitted,
            # Boundaries of compiled optimizer steps taken inside their compiled region (or
            # not taken): the spans on either side are not exactly one iteration each.
            "inexact_span_boundaries": inexact,
            "inexact_span_boundaries_why": _INEXACT_WHY if inexact else "",
            # A stop due at a step boundary that was not a safe point ends at a later one
            # (more spans than asked) or where the training thread is (last span partial).
            "stop_waited_why": self._stop_wait_why,
        }

    def _on_foreign_profiler(self) -> None:
        """The job is starting its own profiler: end dynprof's trace first (the job wins)."""
        with self._lock:
            if self.state != "tracing" or self.session is None or self._transitioning:
                return
            if self.session.thread_id == threading.get_ident():
                log.warning("the job started its own torch.profiler: dynprof's trace ends here (partial)")
                self.stop_requested = "job-profiler"
                self._last_partial = True
                self._last_partial_why = "the job started its own torch.profiler: dynprof's trace ended there"
                self._end("job-profiler")
                return
            # Another thread: Kineto is about to be taken over, and dynprof's profiler can only
            # be stopped from its own thread. Give the trace up without touching the profiler.
            log.warning("the job started its own torch.profiler on another thread: dynprof's trace is abandoned")
            self._reset_to_idle(
                "the job started its own torch.profiler while dynprof was tracing; dynprof gave its trace up"
            )

    def _on_cap(self) -> None:
        with self._lock:
            if self.state == "armed":
                self._reset_to_idle(
                    f"no step boundary reached step {self.start_step} within the cap; nothing was traced "
                    "(for loops without an optimizer, use --duration)"
                )
            elif self.state == "tracing":
                self._request_stop("cap")

    def _end(self, why: str) -> None:
        """Stop the profiler on the tracing thread and hand the export to a worker thread."""
        if self._transitioning:
            return
        self._transitioning = True
        try:
            self._end_unguarded(why)
        finally:
            self._transitioning = False

    def _end_unguarded(self, why: str) -> None:
        session = self.session
        assert session is not None
        self.steps.remove_listener(self._on_boundary)
        self._cancel_timers()
        self._stop_deferred = False
        if session.stop_requested_at == 0.0:
            session.stop_requested_at = time.time()
        try:
            session.stop()
        except Exception as exc:
            log.exception("stopping the profiler failed")
            self._reset_to_idle(f"stopping torch.profiler failed: {type(exc).__name__}: {exc}")
            return
        self.state = "exporting"
        req = self.req
        partial = (bool(req.steps) and self.steps_done < req.steps) or why == "job-profiler"
        spans = self._span_fields(at_boundary=not self._last_partial)
        export = self._export_job = TraceExport()
        self._export_thread = threading.Thread(
            target=self._export,
            args=(session, req, self.steps_done, why, partial, spans, export),
            name="dynprof-trace-export",
            daemon=True,
        )
        self._export_thread.start()


_INEXACT_WHY = (
    "a compiled optimizer step ran inside a torch.compile wrapper that also held other steps (a compiled "
    "loop), or its wrapper's return could not be waited for (the thread's profile and trace functions were "
    "both in use): its boundary was taken inside the compiled region, or not taken"
)


def _profiler_active_error() -> CommandError:
    return CommandError(
        pb.PROFILER_ACTIVE,
        "a torch.profiler started by the job is already active in this process",
        "Kineto allows one profiler per process, and dynprof never takes the job's over. Trace when the "
        "job's own profiler is idle, or use the traces it writes. A profiler the job starts during a dynprof "
        "trace ends that trace first (status partial).",
    )
