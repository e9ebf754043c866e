"""The memory plan's measurement of one step, driven from the agent's step hook.

The rule this module keeps: **the agent's threads never touch the job's torch objects.** Its
modules, parameters, optimizers, tensors and autograd graph belong to the training thread,
which runs torch's C++ with the GIL released; another thread that reads them, holds the last
reference to one, or changes a module's hook tables meanwhile can crash the process inside
libtorch (seen: a NULL object's reference count raised in ``libtorch_python.so`` from the
agent's thread). So the server thread only keeps plain data about a plan, and everything that
touches the job's objects runs on the training thread, at its step boundaries or inside the
measurement's own hooks:

- ``memory_plan`` with a new token (server thread) checks the request and arms a *run*: a
  token, a time and a step listener. Nothing of the job is read.
- At the next step boundary (training thread) the listener finds the job's models from its
  optimizers' parameters (one scan of the garbage collector's objects), checks that the step
  can be measured right (refusing, with the reason, a model that is compiled, sharded, or in a
  process where torch.compile compiled code) and installs the blocks' timer
  (:mod:`collectors.memory.plan.timing`: a forward pre-hook and a forward hook per block, the
  recompute cost from the job's plain steps).
- :data:`TIMED_STEPS` boundaries later it removes the timer and installs the measurement's
  hooks; at the boundary after that it removes them, turns everything it measured into plain
  numbers, and lets go of every reference to the job's objects.
- A measured step that does not end (the job's last optimizer step is behind it, an
  evaluation runs forwards without grad, a step far longer than the job's own) ends at the
  first block forward that shows it, on the training thread, and the client is told why.
- The server thread answers the client with the plain numbers; on CUDA it waits (polling,
  bounded) for the events dynprof recorded to complete and reads their times. Those events are
  dynprof's own objects, which the training thread no longer uses once the step is over.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from collectors.memory.plan.blocks import MeasurementRefused, find_models
from collectors.memory.plan.timing import TIMED_STEPS, BlockTimer, apply_timer, on_cuda
from dynprof.agent._server import CommandError
from dynprof.proto import pb

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

ARMED_FOR_S = 900.0  # an armed measurement whose step does not come within this is dropped
MAX_TOKEN = 64
# The measured step ends at most this long after it began, or this many typical steps (the
# measurement itself slows a step several times: every operator passes through Python).
MEASURED_STEP_MIN_S = 120.0
MEASURED_STEP_TYPICAL = 50.0


def step_time_limit(typical_s: float | None) -> float:
    """How long a measured (or timed) step may take before it is taken as not coming to its end:
    :data:`MEASURED_STEP_TYPICAL` typical steps, at least :data:`MEASURED_STEP_MIN_S`."""
    return max(MEASURED_STEP_MIN_S, MEASURED_STEP_TYPICAL * typical_s) if typical_s else MEASURED_STEP_MIN_S


class PlanRun:
    """One plan's state. The server thread reads ``state``, ``error``, ``help``, ``code`` and
    ``doc`` (plain data); ``measurement`` is the training thread's until the step is over."""

    def __init__(self, token: str, typical_step_s: float) -> None:
        self.token = token
        self.typical_step_s = typical_step_s
        self.state = "armed"  # measuring, stopped, complete, failed
        self.armed_at = time.monotonic()
        self.error = ""
        self.help = ""
        self.code = 0  # an error code (pb) when the measurement was refused; 0 otherwise
        self.doc: dict[str, Any] | None = None
        self.measurement: Any = None
        self.timer: Any = None  # the blocks' timer (training thread's until stopped)
        self.scan_s = 0.0  # finding the models (the garbage collector's objects, GIL held)


class MemoryPlanner:
    timed_steps = TIMED_STEPS  # plain steps whose blocks are timed before the measured one (0: none)

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.run: PlanRun | None = None
        self.last_measurement: dict[str, Any] | None = None  # the latest complete one, for OOM advice
        # a run dropped while timing: its timer and (unstarted) measurement, which hold the job's
        # modules, stopped and let go of on the training thread at its next boundary
        self._dropped: list[Any] = []
        self._lock = threading.RLock()  # state changes; never held while waiting
        # One bound method, kept: the step tracker removes a listener by identity, and each
        # `self._on_step` is a new object.
        self._listener = self._on_step

    # -- the server thread: plain data only --------------------------------------------------
    def handle(self, request: Any) -> tuple[str, Any]:
        import json
        import sys

        token = str(request.token)
        if not token or len(token) > MAX_TOKEN or not token.isprintable():
            raise CommandError(pb.INVALID_ARGUMENT, f"the token must be 1 to {MAX_TOKEN} printable characters")
        checkpoint = getattr(getattr(self.agent, "memory", None), "checkpoint", None)
        if getattr(request, "undo", False):
            if checkpoint is None:
                raise CommandError(
                    pb.UNSUPPORTED,
                    "this job was not started with `dynprof run --checkpoint`: dynprof recomputes nothing in it",
                    "Nothing to undo; checkpointing the job's own code does is the job's to change.",
                )
            state = checkpoint.request_undo()
            return "artifact", pb.ArtifactWritten(path="", status=state, summary_json=json.dumps(checkpoint.status()))
        if checkpoint is not None and checkpoint.busy():
            raise CommandError(
                pb.BUSY,
                "dynprof run --checkpoint is measuring a step of this process",
                "Ask again in a few steps (`dynprof ps --json` shows its state).",
            )
        finish = None
        with self._lock:
            run = self.run
            if run is not None and run.token == token:
                if run.state == "stopped":
                    # its figures are made below, outside the lock (the training thread takes
                    # it at its step boundaries and must never wait for a CUDA event here)
                    run.state = finish = "finishing"
            elif run is not None and run.state in ("armed", "timing", "measuring", "stopped", "finishing"):
                if run.state in ("armed", "timing") and time.monotonic() - run.armed_at > ARMED_FOR_S:
                    # nothing of the job is held while armed; a timer's hooks pass everything
                    # through once inactive, and the training thread removes them at its next
                    # boundary: drop it and arm this one
                    if run.timer is not None:
                        run.timer.active = False
                        self._dropped = [run.timer, run.measurement]
                        run.timer = run.measurement = None
                    run.state, run.error = "failed", "the step did not come"
                else:
                    raise CommandError(
                        pb.BUSY,
                        "a memory plan measurement is already waiting for its step in this process",
                        "Wait for it to finish (one training step), then ask again.",
                    )
                run = None
            else:
                run = None
            if run is None:
                if sys.modules.get("torch") is None:
                    raise CommandError(
                        pb.NO_TORCH, "this process has not imported torch", "Point dynprof at a training process."
                    )
                tracing = _trace_in_progress(self.agent)
                if tracing:
                    raise CommandError(pb.BUSY, *busy_with_trace(tracing))
                steps = self.agent.steps
                if not steps.hook_installed:
                    raise CommandError(
                        pb.UNSUPPORTED,
                        "the optimizer step hook is not installed in this process, so no step can be measured",
                        "The job must step a torch.optim optimizer; see the agent log for why the hook is missing.",
                    )
                if not steps.optimizers:  # the agent's own table of weak references, not read through
                    raise CommandError(
                        pb.UNSUPPORTED,
                        "this process has not stepped an optimizer yet, so its model is not known",
                        "Ask again once training has made a step.",
                    )
                self.run = PlanRun(token, steps.typical_step_s())
                steps.add_listener(self._listener)
                return "artifact", pb.ArtifactWritten(path="", status="armed", summary_json="{}")
        if finish:
            self._finish(run)
        if run.state == "failed" and run.code:
            raise CommandError(run.code, run.error, run.help)
        if run.doc is not None:
            summary = json.dumps(run.doc)
        else:
            summary = json.dumps({"error": run.error, "help": run.help} if run.error else {})
        state = "measuring" if run.state in ("finishing", "timing") else run.state
        return "artifact", pb.ArtifactWritten(path="", status=state, summary_json=summary)

    def _finish(self, run: PlanRun) -> None:
        """The figures of a stopped run, from plain data (and dynprof's own CUDA events)."""
        try:
            timer = run.timer
            if timer is not None:
                apply_timer(run.measurement, timer)
            doc = run.measurement.result()
            # the median of the latest steps (the measured one among them moves it little)
            typical = run.typical_step_s or self.agent.steps.typical_step_s()
            doc["typical_step_s"] = round(typical, 6) if typical else None
            doc["model_scan_s"] = round(run.scan_s, 6)
            run.doc = doc
            run.state = "complete"
            self.last_measurement = doc
        except Exception as exc:
            log.exception("memory plan figures failed")
            run.state, run.error = "failed", f"{type(exc).__name__}: {exc}"
        run.measurement = run.timer = None

    def measuring(self) -> str:
        """``armed`` or ``measuring`` while a measurement waits for or runs its step (or times the
        plain steps before it), else ``""``."""
        run = self.run
        if run is None:
            return ""
        return {"armed": "armed", "timing": "measuring", "measuring": "measuring"}.get(run.state, "")

    # -- the training thread: every touch of the job's objects -----------------------------
    def _on_step(self, count: int) -> None:
        # At a step boundary, on the thread that steps.
        with self._lock:
            self._step_locked(self.run)

    def _step_locked(self, run: PlanRun | None) -> None:
        self._let_go_dropped()
        if run is None or run.state not in ("armed", "timing", "measuring"):
            self.agent.steps.remove_listener(self._listener)
            return
        try:
            if run.state == "armed":
                if time.monotonic() - run.armed_at > ARMED_FOR_S:
                    self._fail(run, "the step did not come")
                    return
                tracing = _trace_in_progress(self.agent)
                if tracing:  # a trace was asked for at the same moment: it goes first
                    self._fail(run, busy_with_trace(tracing)[0])
                    return
                self._begin(run)
            elif run.state == "timing":
                run.timer.boundary()
                if run.timer.steps >= self.timed_steps:
                    run.timer.stop()
                    run.state = "measuring"
                    run.measurement.start()
            elif run.state == "measuring":
                run.measurement.stop()
                run.measurement.freeze()
                run.state = "stopped"
                self.agent.steps.remove_listener(self._listener)
        except Exception as exc:
            log.exception("memory plan measurement failed")
            self._fail(run, f"{type(exc).__name__}: {exc}")

    def _let_go_dropped(self) -> None:
        dropped, self._dropped = self._dropped, []
        for thing in dropped:
            if thing is not None:
                thing.stop()  # a timer's hooks off; a measurement never started has none
                release = getattr(thing, "release", None)
                if release is not None:
                    release()
        del dropped

    def _begin(self, run: PlanRun) -> None:
        from collectors.memory.plan.capture import StepMeasurement

        steps = self.agent.steps
        optimizers = [o for o in (r() for r in list(steps.optimizers.values())) if o is not None]
        t0 = time.perf_counter()
        roots = find_models(optimizers) if optimizers else []
        run.scan_s = time.perf_counter() - t0
        if not roots:
            import sys

            if "deepspeed" in sys.modules:
                # ZeRO stages 1 and 2 step fp32 partitions flattened from the parameters
                # (seen with DeepSpeed 0.19.8): the model is not found from them.
                self._refuse(
                    run,
                    pb.UNSUPPORTED,
                    "no nn.Module holds the optimizers' parameters: this process runs DeepSpeed, whose ZeRO "
                    "optimizer steps flattened partitions of the parameters, not the model's own",
                    "The memory plan does not measure a DeepSpeed ZeRO job. Measure an eager run of the same "
                    "model without DeepSpeed (one GPU, a smaller config) and apply the plan's DeepSpeed recipe.",
                )
                return
            self._refuse(
                run,
                pb.UNSUPPORTED,
                "no nn.Module holds the optimizers' parameters",
                "The memory plan needs the model as an nn.Module whose parameters the optimizer steps.",
            )
            return
        typical = run.typical_step_s or steps.typical_step_s()
        limit = step_time_limit(typical)
        try:
            measurement = StepMeasurement(roots, optimizers, time_limit_s=limit, on_end=self._ended)
        except MeasurementRefused as exc:
            self._refuse(
                run,
                pb.UNSUPPORTED,
                f"the memory plan cannot measure this job right: {exc}",
                exc.help
                or "Measure an eager, unsharded run of the same model (one GPU, a smaller config) and plan from it.",
            )
            return
        del roots, optimizers
        run.measurement = measurement
        if self.timed_steps <= 0:
            run.state = "measuring"
            measurement.start()
            return
        # the blocks' plain forward time first (the recompute cost), then the measured step
        run.timer = BlockTimer(
            measurement.blocks, cuda=on_cuda(measurement.blocks), time_limit_s=limit, on_end=self._timer_ended
        )
        run.state = "timing"
        run.timer.start()

    def _ended(self, why: str) -> None:
        """The measurement ended itself before the step's end (inside one of its hooks, on the
        training thread): the step it waited for did not come."""
        with self._lock:
            run = self.run
            if run is None or run.state != "measuring":
                return
            self._end_early(run, why)

    def _timer_ended(self, why: str) -> None:
        """The blocks' timer ended itself before its steps' end (inside one of its hooks, on the
        training thread, its hooks already off)."""
        with self._lock:
            run = self.run
            if run is None or run.state != "timing":
                return
            measurement, run.measurement = run.measurement, None
            if measurement is not None:
                measurement.release()  # never started: it holds the blocks, let go of here
            self._end_early(run, why, "the steps timed before the measured one did not end")

    def _end_early(self, run: PlanRun, why: str, what: str = "the measured step did not end") -> None:
        log.warning("dynprof: the memory plan measurement ended early: %s", why)
        run.measurement = run.timer = None
        run.state, run.error = "failed", f"{what}: {why}"
        run.help = (
            f"The plan times {self.timed_steps} training steps and measures the next one (forward, backward, optimizer "
            "step). Ask while the job trains, not during an evaluation or after its last step."
        )
        self.agent.steps.remove_listener(self._listener)

    def _refuse(self, run: PlanRun, code: int, message: str, help_text: str) -> None:
        run.state, run.code, run.error, run.help = "failed", code, message, help_text
        self.agent.steps.remove_listener(self._listener)

    def _fail(self, run: PlanRun, error: str) -> None:
        self.agent.steps.remove_listener(self._listener)
        timer, run.timer = run.timer, None
        if timer is not None:
            timer.stop()
        measurement, run.measurement = run.measurement, None
        if measurement is not None:
            try:
                measurement.stop()
            except Exception:
                log.exception("stopping the memory plan measurement failed")
        run.state, run.error = "failed", error

    def at_exit(self) -> None:
        # The interpreter is ending on the thread that runs the exit handlers (the main one).
        run = self.run
        if run is None:
            return
        try:
            self.agent.steps.remove_listener(self._listener)
            self._let_go_dropped()
            if run.timer is not None:
                run.timer.stop()
            if run.measurement is not None and run.state == "measuring":
                run.measurement.stop()
        except Exception:
            log.exception("stopping the memory plan measurement failed")


def _trace_in_progress(agent: Any) -> str:
    """The state of this process's dynprof trace when one is armed or records, else ``""``."""
    trace = getattr(agent, "trace", None)
    state = getattr(trace, "state", "")
    return state if state in ("armed", "tracing") else ""


def busy_with_trace(state: str) -> tuple[str, str]:
    """Why a measurement is refused while a trace is ``state``, and what to do."""
    return (
        f"a dynprof trace is {state} in this process: a memory plan measures its step through a dispatch "
        "mode that runs every operator through Python, so the trace would show each operator of that step "
        "twice and its time as the job's",
        "Ask for the memory plan once the trace has ended (`dynprof ps` shows it), or end it with `dynprof stop`.",
    )
