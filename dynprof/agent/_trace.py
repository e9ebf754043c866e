"""On-demand torch.profiler traces: the agent's side of ``dynprof start`` / ``dynprof stop``.

States: ``idle`` -> ``armed`` (waiting for the start step) -> ``tracing`` -> ``exporting`` ->
``idle``. The profiler is started, stepped and stopped on the training thread: at optimizer
step boundaries (step mode), or through the main thread's pending-call queue when there are
no steps to align to (duration mode, or a process that never steps an optimizer). Export runs
on a background thread. A trace always ends by itself: after its steps or duration, or at the
hard cap, whether or not the CLI that asked for it is still there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from collectors.torch_trace import KIND, TRACE_FILE, TraceOptions, TraceSession
from dynprof.agent._mainthread import call_soon_in_main_thread
from dynprof.agent._server import CommandError
from dynprof.proto import pb
from dynprof.store import ArtifactStore

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

DEFAULT_MAX_DURATION_S = float(os.environ.get("DYNPROF_TRACE_MAX_S", "600"))


class TraceController:
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
        self.armed_at = 0.0
        self.last_artifact = ""
        self.last_status = ""
        self.last_error = ""
        self.last_group = ""
        self._timers: list[threading.Timer] = []
        self._export_thread: threading.Thread | None = None

    # -- protocol handlers (server thread) -------------------------------------------------
    def handle_start(self, msg: Any) -> tuple[str, Any]:
        import sys

        if msg.steps and msg.duration_s:
            raise CommandError(pb.INVALID_ARGUMENT, "give --steps or --duration, not both")
        if msg.duration_s < 0 or msg.max_duration_s < 0:
            raise CommandError(pb.INVALID_ARGUMENT, "durations must be positive")
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
        with self._lock:
            if self.state != "idle":
                raise CommandError(
                    pb.BUSY,
                    f"a trace is already {self.state} (group {self.last_group or '-'})",
                    f"Wait for it to finish, or end it with `dynprof stop --pid {os.getpid()}`.",
                )
            now_step = self.steps.step
            step_aligned = msg.steps > 0 or (msg.duration_s == 0 and self._steps_flowing())
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
            self.armed_at = time.time()
            self.state = "armed"
            max_s = msg.max_duration_s or DEFAULT_MAX_DURATION_S
            if msg.duration_s:
                max_s = max(max_s, msg.duration_s * 2 + 10)
            self._timer(max_s, self._on_cap)
            if step_aligned:
                self.steps.add_listener(self._on_boundary)
            elif not call_soon_in_main_thread(self._start_in_main_thread):
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
            if self.state != "tracing":
                raise CommandError(pb.NOT_RUNNING, "no trace is running")
            self._request_stop("request")
            return "trace_stopped", pb.TraceStopped(trace=self.state_pb())

    def state_pb(self) -> Any:
        req = self.req
        session = self.session
        return pb.TraceState(
            state=self.state,
            start_step=self.start_step,
            steps=req.steps if req is not None else 0,
            steps_done=self.steps_done,
            active_since=session.started_at if session is not None and self.state == "tracing" else 0.0,
            last_artifact=self.last_artifact,
            last_error=self.last_error,
            group_id=self.last_group,
            last_artifact_status=self.last_status,
        )

    # -- helpers -----------------------------------------------------------------------------
    def _steps_flowing(self) -> bool:
        s = self.steps
        if not s.hook_installed or not s.last_step_at:
            return False
        window = max(2.0, 5 * s.step_time_s)
        return time.time() - s.last_step_at < window

    def _timer(self, seconds: float, fn: Any) -> None:
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
        o = self.req.options
        return TraceOptions(
            record_shapes=o.record_shapes,
            with_stack=o.with_stack,
            profile_memory=o.profile_memory,
            with_flops=o.with_flops,
            with_modules=o.with_modules,
            activities=list(o.activities),
        )

    # -- training-thread side ---------------------------------------------------------------
    def _begin(self, first_step: int | None) -> None:
        """Start the profiler on the calling thread. Caller holds the lock."""
        session = TraceSession(self._options(), self._distributed_info())
        try:
            session.start(first_step)
        except Exception as exc:
            log.exception("starting the profiler failed")
            self._reset_to_idle(f"starting torch.profiler failed: {type(exc).__name__}: {exc}")
            return
        self.session = session
        self.state = "tracing"
        req = self.req
        if req.duration_s:
            self._timer(req.duration_s, lambda: self._request_stop_locked("duration"))
        log.info("trace started at step %d", self.steps.step)

    def _on_boundary(self, step: int) -> None:
        with self._lock:
            if self.state == "armed":
                if step >= self.start_step:
                    self._begin(first_step=step + 1)
                return
            if self.state != "tracing" or self.session is None:
                return
            if threading.get_ident() != self.session.thread_id:
                return
            self.steps_done += 1
            req = self.req
            if self.stop_requested or (req.steps and self.steps_done >= req.steps):
                self._end(self.stop_requested or "steps")
            else:
                self.session.step()

    def _start_in_main_thread(self) -> None:
        with self._lock:
            if self.state == "armed" and self.start_step == 0:
                first = self.steps.step + 1 if self.steps.hook_installed else None
                self._begin(first_step=first)
                if self.state == "tracing" and self.steps.hook_installed:
                    self.steps.add_listener(self._on_boundary)

    def _stop_in_main_thread(self) -> None:
        with self._lock:
            if self.state == "tracing" and self.session is not None and self.stop_requested:
                if self.session.thread_id == threading.get_ident():
                    self._end(self.stop_requested)

    def _request_stop_locked(self, why: str) -> None:
        with self._lock:
            self._request_stop(why)

    def _request_stop(self, why: str) -> None:
        if self.state != "tracing" or self.session is None:
            return
        if self.stop_requested is None:
            self.stop_requested = why
        if self.session.thread_id == threading.main_thread().ident:
            call_soon_in_main_thread(self._stop_in_main_thread)
        # Otherwise the next step boundary on the tracing thread ends it.

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
        session = self.session
        assert session is not None
        self.steps.remove_listener(self._on_boundary)
        self._cancel_timers()
        try:
            session.stop()
        except Exception as exc:
            log.exception("stopping the profiler failed")
            self._reset_to_idle(f"stopping torch.profiler failed: {type(exc).__name__}: {exc}")
            return
        self.state = "exporting"
        req = self.req
        partial = bool(req.steps) and self.steps_done < req.steps
        self._export_thread = threading.Thread(
            target=self._export,
            args=(session, req, self.steps_done, why, partial),
            name="dynprof-trace-export",
            daemon=True,
        )
        self._export_thread.start()

    def _export(self, session: TraceSession, req: Any, steps_done: int, why: str, partial: bool) -> None:
        ident = self.agent.identity
        status = "partial" if partial else "complete"
        error = ""
        path = ""
        try:
            store = ArtifactStore()
            options = {
                "steps": req.steps,
                "duration_s": req.duration_s,
                "at_step": req.at_step,
                "group_id": req.group_id,
                **session.options.to_dict(),
            }
            writer = store.create(
                KIND,
                job=ident.job_id,
                host=ident.host,
                rank=ident.rank,
                options=options,
                extra={"world_size": ident.world_size, "local_rank": ident.local_rank},
            )
            try:
                summary = session.export(writer.file_path(TRACE_FILE))
                summary.update(
                    steps_requested=req.steps, steps_captured=steps_done, stopped_by=why, start_step=self.start_step
                )
                art = writer.finish(status, summary=summary)
            except BaseException as exc:
                writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
                raise
            path = str(art.path)
            log.info("trace written to %s (%s)", path, status)
        except Exception as exc:
            log.exception("exporting the trace failed")
            status, error = "failed", f"exporting the trace failed: {type(exc).__name__}: {exc}"
        with self._lock:
            self.last_artifact = path
            self.last_status = status
            self.last_error = error
            self.state = "idle"
            self.session = None

    # -- process exit ------------------------------------------------------------------------
    def at_exit(self) -> None:
        """Flush a trace that is still running as a partial artifact."""
        with self._lock:
            if self.state == "tracing" and self.session is not None:
                self.stop_requested = "exit"
                session, req, done = self.session, self.req, self.steps_done
                self.steps.remove_listener(self._on_boundary)
                self._cancel_timers()
                try:
                    session.stop()
                except Exception:
                    log.exception("stopping the profiler at exit failed")
                    return
                self.state = "exporting"
            elif self.state == "armed":
                self._reset_to_idle("the process exited before the trace started")
                return
            else:
                session = None
        if session is not None:
            self._export(session, req, done, "exit", partial=True)
        thread = self._export_thread
        if thread is not None and thread.is_alive():
            thread.join(timeout=60)
