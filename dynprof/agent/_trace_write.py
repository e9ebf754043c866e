"""Writing a trace, and what the job's exit does with one: the other half of ``_trace``.

A trace the controller (:class:`dynprof.agent._trace.TraceController`) has stopped is written
on its own thread (``dynprof-trace-export``) into an artifact of the store. When the job exits,
a trace still running is stopped and written as partial, and a trace being written is waited
for, at most DYNPROF_TRACE_EXIT_WAIT_S; past that the exit records it as a failed artifact
that says why. Whoever claims the write first (the export thread or the exit) finishes it.

:class:`TraceWriting` holds these steps; the controller is one, and owns the state they read.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from collectors.torch_trace import KIND, TRACE_FILE, TRACE_UNCOMPRESSED_FILE, TraceSession
from dynprof.store import ArtifactStore

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent
    from dynprof.agent._steps import StepTracker

log = logging.getLogger("dynprof.agent")

# How long the job's exit waits for a trace being written. Export costs about 5 us per recorded
# event on a 2-core CPU machine (scripts/bench_trace_export.py prints it), so the default covers
# some 12 million events; a longer write is given up and recorded as a failed artifact.
DEFAULT_EXIT_WAIT_S = 60.0
MAX_EXIT_WAIT_S = 3600.0
# Once the write has published its artifact (a rename), the exit waits this much more for it.
EXIT_PUBLISH_WAIT_S = 5.0


def exit_wait_s() -> float:
    """DYNPROF_TRACE_EXIT_WAIT_S: the longest the job's exit is held for a trace being written."""
    text = os.environ.get("DYNPROF_TRACE_EXIT_WAIT_S", "").strip()
    try:
        value = float(text) if text else DEFAULT_EXIT_WAIT_S
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and 0 <= value <= MAX_EXIT_WAIT_S):
        log.warning(
            "DYNPROF_TRACE_EXIT_WAIT_S=%r is not a duration in [0, %g] s; using %g",
            text,
            MAX_EXIT_WAIT_S,
            DEFAULT_EXIT_WAIT_S,
        )
        value = DEFAULT_EXIT_WAIT_S
    return value


class TraceExport:
    """One trace being written: its artifact writer, finished by the export thread or, when the
    job's exit cannot wait any longer, by the exit hook (as failed). Whoever claims it first
    finishes it; the other leaves the writer alone."""

    def __init__(self) -> None:
        self.writer: Any = None  # the ArtifactWriter, once created
        self.lock = threading.Lock()
        self.owner = ""

    def claim(self, who: str) -> bool:
        with self.lock:
            if not self.owner:
                self.owner = who
            return self.owner == who


class TraceWriting:
    """Writing the trace and the job's exit, as the trace controller does them. The controller
    sets the state below (in its ``__init__``) and provides the four steps it has of its own."""

    agent: Agent
    steps: StepTracker
    _lock: Any  # the controller's re-entrant lock
    state: str
    req: Any
    session: TraceSession | None
    start_step: int
    steps_done: int
    stop_requested: str | None
    last_artifact: str
    last_status: str
    last_error: str
    _export_thread: threading.Thread | None
    _export_job: TraceExport | None
    _exiting: bool
    _last_partial_why: str

    def _reset_to_idle(self, error: str = "") -> None:
        raise NotImplementedError

    def _cancel_timers(self) -> None:
        raise NotImplementedError

    def _on_boundary(self, step: int) -> None:
        raise NotImplementedError

    def _span_fields(self, at_boundary: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _create_writer(self, session: TraceSession, req: Any) -> Any:
        ident = self.agent.identity
        options = {
            "steps": req.steps,
            "duration_s": req.duration_s,
            "at_step": req.at_step,
            "group_id": req.group_id,
            **session.options.to_dict(),
        }
        return ArtifactStore().create(
            KIND,
            job=ident.job_id,
            host=ident.host,
            rank=ident.rank,
            options=options,
            extra={
                "world_size": ident.world_size,
                "local_rank": ident.local_rank,
                # which physical GPU the rank's steps ran on: ranks that share one contend on it
                "gpu_device": self.steps.gpu.device_identity(sys.modules.get("torch")),
            },
        )

    def _export(
        self,
        session: TraceSession,
        req: Any,
        steps_done: int,
        why: str,
        partial: bool,
        spans: dict[str, Any],
        export: TraceExport,
    ) -> None:
        status = "partial" if partial else "complete"
        error = ""
        path = ""
        try:
            with export.lock:
                if export.owner:
                    return  # the job's exit gave this write up before it began
                if export.writer is None:
                    export.writer = self._create_writer(session, req)
            writer = export.writer
            try:
                summary = session.export(writer.file_path(TRACE_FILE))
                summary.update(
                    steps_requested=req.steps, steps_captured=steps_done, stopped_by=why, start_step=self.start_step
                )
                summary.update(spans)
                if not export.claim("export"):
                    return  # the job's exit gave this write up and recorded it as failed
                art = writer.finish(status, summary=summary)
            except BaseException as exc:
                if export.claim("export"):
                    writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
                    raise
                return
            path = str(art.path)
            log.info("trace written to %s (%s)", path, status)
        except Exception as exc:
            log.exception("exporting the trace failed")
            status, error = "failed", f"exporting the trace failed: {type(exc).__name__}: {exc}"
        with self._lock:
            self._finish_export(path, status, error)

    def _finish_export(self, path: str, status: str, error: str) -> None:
        self.last_artifact = path
        self.last_status = status
        self.last_error = error
        self.state = "idle"
        self.session = None
        self._export_job = None

    # -- process exit ------------------------------------------------------------------------
    def at_exit(self) -> None:
        """Flush a trace that is still running as a partial artifact, and wait (at most
        DYNPROF_TRACE_EXIT_WAIT_S) for a trace being written. Whatever happens, the store holds
        the trace or a failed artifact that says why, and one line on stderr says which."""
        self._exiting = True
        with self._lock:
            if self.state == "armed":
                self._reset_to_idle("the process exited before the trace started")
                return
            if self.state == "tracing" and self.session is not None:
                if not self._flush_at_exit():
                    return
            elif self.state != "exporting":
                return
            thread = self._export_thread
        if thread is not None and thread.is_alive():
            wait_s = exit_wait_s()
            thread.join(timeout=wait_s)
            if thread.is_alive():
                if self._give_up_at_exit(wait_s):
                    self._say_at_exit(gave_up_after=wait_s)
                    return
                thread.join(timeout=EXIT_PUBLISH_WAIT_S)  # it is publishing its artifact
        self._say_at_exit()

    def _flush_at_exit(self) -> bool:
        """Stop the trace in progress and start writing it (partial). Caller holds the lock.
        The artifact's place is known at once, for a `dynprof stop` that comes meanwhile."""
        session, req = self.session, self.req
        assert session is not None
        self.stop_requested = "exit"
        self._last_partial_why = "the process exited while it traced"
        spans = self._span_fields(at_boundary=False)
        self.steps.remove_listener(self._on_boundary)
        self._cancel_timers()
        try:
            session.stop()
        except Exception as exc:
            log.exception("stopping the profiler at exit failed")
            self._reset_to_idle(f"stopping torch.profiler at exit failed: {type(exc).__name__}: {exc}")
            return False
        self.state = "exporting"
        export = self._export_job = TraceExport()
        try:
            export.writer = self._create_writer(session, req)
        except Exception as exc:
            log.warning(
                "warning: the trace in progress when the job exited was lost: its artifact could not be created: %s: %s",
                type(exc).__name__,
                exc,
            )
            self._finish_export("", "failed", f"creating the trace's artifact at exit failed: {exc}")
            return False
        args = (session, req, self.steps_done, "exit", True, spans, export)
        thread = threading.Thread(target=self._export, args=args, name="dynprof-trace-export", daemon=True)
        try:
            thread.start()
            self._export_thread = thread
        except RuntimeError:  # no new thread this late in the exit: write it here, unbounded
            self._export_thread = None
            self._export(*args)
        return True

    def _give_up_at_exit(self, wait_s: float) -> bool:
        """The job exits and the trace is still being written: record it as failed, with why.
        False when the write got there first (it is publishing its artifact)."""
        with self._lock:
            export = self._export_job
            if export is None or not export.claim("exit"):
                return False
            session, req = self.session, self.req
        error = (
            f"the job exited while this trace was being written, and the write had not finished after "
            f"{wait_s:g} s (DYNPROF_TRACE_EXIT_WAIT_S, the longest dynprof holds a job's exit); "
            "the unfinished trace file was removed"
        )
        path = ""
        try:
            with export.lock:
                writer = export.writer
            if writer is None:
                if session is None:
                    raise RuntimeError("the trace being written is gone")
                writer = self._create_writer(session, req)
            for name in (TRACE_FILE, TRACE_UNCOMPRESSED_FILE):  # the write's files, half written
                with contextlib.suppress(OSError):
                    os.unlink(writer.path / name)
            path = str(writer.finish("failed", error=error).path)
        except Exception as exc:
            log.info("recording the unfinished trace at exit failed", exc_info=True)
            error = f"{error}; recording it failed: {type(exc).__name__}: {exc}"
        with self._lock:
            self._finish_export(path, "failed", error)
        return True

    def _say_at_exit(self, gave_up_after: float | None = None) -> None:
        """One line on the job's stderr: what became of the trace the exit waited for."""
        with self._lock:
            path, status, error = self.last_artifact, self.last_status, self.last_error
        if status in ("complete", "partial") and path:
            log.warning("trace written at exit (%s): %s", status, path)
        elif gave_up_after is not None and path:
            log.warning(
                "warning: the job exited before its trace was written (not finished after %g s); recorded as "
                "failed: %s (set DYNPROF_TRACE_EXIT_WAIT_S to wait longer)",
                gave_up_after,
                path,
            )
        elif path:
            log.warning("warning: the trace written at exit failed (%s): %s", error, path)
        else:
            log.warning("warning: the trace in progress when the job exited was lost: %s", error or "unknown error")
