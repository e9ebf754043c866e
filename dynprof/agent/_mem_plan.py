"""The memory plan's measurement of one step, driven from the agent's step hook.

``memory_plan`` with a new token arms a measurement: the job's models are found from its
optimizers' parameters (one scan of the garbage collector's objects, on the server thread), and
a step listener is added. At the next step boundary the listener installs the measurement's
hooks on the training thread; at the one after, it removes them and itself. The measured step is
the only one that runs with them; nothing stays installed after it (nor when the agent stops).
The figures are computed on the server thread when the client asks again with the same token.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

ARMED_FOR_S = 900.0  # an armed measurement whose step does not come within this is dropped
MAX_TOKEN = 64


class PlanRun:
    def __init__(self, token: str, measurement: Any, typical_step_s: float) -> None:
        self.token = token
        self.measurement = measurement
        self.typical_step_s = typical_step_s
        self.state = "armed"  # measuring, stopped, complete, failed
        self.armed_at = time.monotonic()
        self.error = ""
        self.doc: dict[str, Any] | None = None
        self.scan_s = 0.0  # finding the models (the garbage collector's objects, GIL held)


class MemoryPlanner:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.run: PlanRun | None = None
        self.last_measurement: dict[str, Any] | None = None  # the latest complete one, for OOM advice
        self._lock = threading.Lock()
        # One bound method, kept: the step tracker removes a listener by identity, and each
        # `self._on_step` is a new object.
        self._listener = self._on_step

    def handle(self, request: Any) -> tuple[str, Any]:
        import json
        import sys

        from dynprof.agent._server import CommandError
        from dynprof.proto import pb

        token = str(request.token)
        if not token or len(token) > MAX_TOKEN or not token.isprintable():
            raise CommandError(pb.INVALID_ARGUMENT, f"the token must be 1 to {MAX_TOKEN} printable characters")
        with self._lock:
            run = self.run
            if run is not None and run.token == token:
                if run.state == "stopped":
                    self._finish(run)
                summary = json.dumps(run.doc) if run.doc is not None else json.dumps({"error": run.error})
                return "artifact", pb.ArtifactWritten(path="", status=run.state, summary_json=summary)
            if run is not None and run.state in ("armed", "measuring"):
                if run.state == "armed" and time.monotonic() - run.armed_at > ARMED_FOR_S:
                    self._drop(run)
                else:
                    raise CommandError(
                        pb.BUSY,
                        "a memory plan measurement is already waiting for its step in this process",
                        "Wait for it to finish (one training step), then ask again.",
                    )
            torch = sys.modules.get("torch")
            if torch is None:
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
            optimizers = [o for o in (r() for r in list(steps.optimizers.values())) if o is not None]
            if not optimizers:
                raise CommandError(
                    pb.UNSUPPORTED,
                    "this process has not stepped an optimizer yet, so its model is not known",
                    "Ask again once training has made a step.",
                )
            from collectors.memory.plan_capture import MeasurementRefused, StepMeasurement, find_models

            t0 = time.perf_counter()
            roots = find_models(optimizers)
            scan_s = time.perf_counter() - t0
            if not roots:
                if "deepspeed" in sys.modules:
                    # ZeRO stages 1 and 2 step fp32 partitions flattened from the parameters
                    # (seen with DeepSpeed 0.19.8): the model is not found from them.
                    raise CommandError(
                        pb.UNSUPPORTED,
                        "no nn.Module holds the optimizers' parameters: this process runs DeepSpeed, whose ZeRO "
                        "optimizer steps flattened partitions of the parameters, not the model's own",
                        "The memory plan does not measure a DeepSpeed ZeRO job. Measure an eager run of the same "
                        "model without DeepSpeed (one GPU, a smaller config) and apply the plan's DeepSpeed recipe.",
                    )
                raise CommandError(
                    pb.UNSUPPORTED,
                    "no nn.Module holds the optimizers' parameters",
                    "The memory plan needs the model as an nn.Module whose parameters the optimizer steps.",
                )
            try:
                measurement = StepMeasurement(roots, optimizers)
            except MeasurementRefused as exc:
                raise CommandError(
                    pb.UNSUPPORTED,
                    f"the memory plan cannot measure this job right: {exc}",
                    "Measure an eager, unsharded run of the same model (one GPU, a smaller config) and plan from it.",
                ) from None
            run = PlanRun(token, measurement, steps.typical_step_s())
            run.scan_s = scan_s
            self.run = run
            steps.add_listener(self._listener)
            return "artifact", pb.ArtifactWritten(path="", status="armed", summary_json="{}")

    def measuring(self) -> str:
        """``armed`` or ``measuring`` while a measurement waits for or runs its step, else ``""``."""
        run = self.run
        return run.state if run is not None and run.state in ("armed", "measuring") else ""

    def _on_step(self, count: int) -> None:
        # On the training thread, at a step boundary: only start or stop hooks here.
        run = self.run
        if run is None:
            self.agent.steps.remove_listener(self._listener)
            return
        try:
            if run.state == "armed":
                if time.monotonic() - run.armed_at > ARMED_FOR_S:
                    self._drop(run)
                    return
                tracing = _trace_in_progress(self.agent)
                if tracing:  # a trace was asked for at the same moment: it goes first
                    self.agent.steps.remove_listener(self._listener)
                    run.measurement = None
                    run.state, run.error = "failed", busy_with_trace(tracing)[0]
                    return
                run.state = "measuring"
                run.measurement.start()
            elif run.state == "measuring":
                run.measurement.stop()
                run.state = "stopped"
                self.agent.steps.remove_listener(self._listener)
        except Exception as exc:
            log.exception("memory plan measurement failed")
            run.measurement.stop()
            run.state, run.error = "failed", f"{type(exc).__name__}: {exc}"
            self.agent.steps.remove_listener(self._listener)

    def _finish(self, run: PlanRun) -> None:
        try:
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
        run.measurement = None

    def _drop(self, run: PlanRun) -> None:
        self.agent.steps.remove_listener(self._listener)
        if run.measurement is not None:
            run.measurement.stop()
        run.state, run.error = "failed", "the step did not come"

    def at_exit(self) -> None:
        run = self.run
        if run is None:
            return
        try:
            self.agent.steps.remove_listener(self._listener)
            if run.measurement is not None:
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
