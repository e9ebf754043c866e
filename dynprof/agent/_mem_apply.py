"""``dynprof run --checkpoint BUDGET|auto``: the memory plan applied to the running job, and
checked.

Only a job that asked (``DYNPROF_CHECKPOINT`` in its environment, which ``dynprof run
--checkpoint`` sets) is ever changed. The rule of dynprof/agent/_mem_plan.py holds: the
agent's threads never touch the job's torch objects; each step below that does runs on the
training thread, at a step boundary (the step tracker's listener):

1. the 5th boundary: the blocks' plain forward is timed for the next
   ``BLOCK_TIMED_STEPS`` steps (the recompute cost, as ``dynprof
   memory plan`` times it); the 8th (warm-up behind; the baseline step time is the median of
   the job's steps from the 3rd boundary on): the step after it is measured
   (:class:`~collectors.memory.plan.capture.StepMeasurement`, as ``dynprof memory plan``
   measures). While a plan measurement or a trace is under way, each waits a boundary;
2. the next boundary: the measurement stops and turns into plain numbers; a thread of the
   agent plans from them (:func:`collectors.memory.plan.solve.make_plan`);
3. the boundary after the plan is ready: the chosen blocks' forward is wrapped in
   non-reentrant ``torch.utils.checkpoint`` (:mod:`collectors.memory.plan.apply`; a block
   already checkpointed, compiled, or of a model whose cache a recompute would fill twice is
   refused in words, and nothing is wrapped), and the next step's real peak is read;
4. a peak over the budget plans again for the budget less what the prediction missed (more
   blocks), at most :data:`MAX_ROUNDS` times; a budget that recomputation cannot reach takes
   every wrapper back and says so;
5. under the budget: the next :data:`TIMED_STEPS` steps' median time is the verified step time.

``dynprof ps --json`` shows the state (:meth:`CheckpointApplier.status`), the agent's log and
the job's stderr say each outcome, a ``memory-plan`` artifact keeps the measurement, the plan
and what was verified, and ``dynprof memory plan --pid P --undo`` takes the wrappers back at
the next boundary.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from collectors.memory.plan.apply import (
    ENV,
    MAX_SPEC,
    StepPeak,
    auto_budget,
    blocks_by_name,
    known_tensors,
    parse_spec,
    why_not_wrap,
    wrap,
)
from collectors.memory.plan.blocks import MeasurementRefused, find_models
from collectors.memory.plan.budget import parse_budget
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.timing import TIMED_STEPS as BLOCK_TIMED_STEPS
from collectors.memory.plan.timing import BlockTimer, apply_timer, on_cuda
from dynprof.agent._mem_plan import busy_with_trace, step_time_limit
from dynprof.store import ArtifactStore
from dynprof.units import human_bytes

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

# The step after the 8th boundary is measured: the job's first steps are its slowest (kernels
# chosen, caches filled, a framework's first-step work), and the baseline step time is the
# median of the steps between the 3rd boundary and the measured one, not of those.
WARMUP_BOUNDARIES = 8
BASELINE_SKIP = 2  # the first step intervals left out of the baseline
MAX_ROUNDS = 3  # plans made again after a verified peak over the budget
TIMED_STEPS = 5
# States in which nothing more happens without a request (the listener is off).
FINAL = ("applied", "fits-already", "unreachable", "refused", "failed", "undone")


class CheckpointApplier:
    """The state of ``--checkpoint`` in this process. ``state`` and the figures are plain data
    that any thread reads; ``_wrapped``, ``_measurement`` and ``_peak`` hold the job's objects
    (weakly, for the wrapped blocks) and are the training thread's."""

    def __init__(self, agent: Agent, spec: str) -> None:
        self.agent = agent
        self.spec = spec
        self.state = "waiting"
        self.detail = (
            f"waiting for step boundary {WARMUP_BOUNDARIES - BLOCK_TIMED_STEPS} to time the blocks, then measure a step"
        )
        self.boundaries = 0
        self._count = 0  # the job's optimizer steps so far (the step tracker's count)
        self.wrapped_from_step: int | None = None  # the first step run with the wrappers (0-based)
        self.budget_bytes: int | None = None
        self.budget_source = ""
        self.modules: list[str] = []
        self.refused: list[str] = []
        self.notes: list[str] = []
        self.measured_peak_bytes: int | None = None
        self.predicted_peak_bytes: int | None = None
        self.verified_peak_bytes: int | None = None
        self.verified_peak_source = ""
        self.baseline_step_s: float | None = None
        self.added_step_s: float | None = None
        self.verified_step_s: float | None = None
        self.floor_bytes: int | None = None
        self.rounds = 0
        self.artifact = ""
        self.measurement_doc: dict[str, Any] | None = None
        self.plan_doc: dict[str, Any] | None = None
        self._pending: list[str] | None = None  # the planning thread's choice, applied at the next boundary
        self._undo_reason = ""  # the planning thread asks the training thread to take the wrappers back
        self._undo_requested = False
        self._wrapped: list[Any] = []
        self._measurement: Any = None
        self._timer: Any = None  # the blocks' timer before the measured step (training thread's)
        self._timed: Any = None  # the same once stopped: plain numbers and dynprof's own events
        self._peak: Any = None
        self._times: list[float] = []
        self._last_t = 0.0
        self._lock = threading.RLock()
        self._listener = self._on_step

    # -- any thread: plain data ------------------------------------------------------------------
    def start(self) -> None:
        self.agent.steps.add_listener(self._listener)
        log.info("checkpoint %s asked: the step after boundary %d is measured", self.spec, WARMUP_BOUNDARIES)

    def busy(self) -> bool:
        """Whether a measurement or a peak reading of this process's steps is under way."""
        return self.state in ("measuring", "verifying")

    def predicted_step_s(self) -> float | None:
        if self.baseline_step_s is None or self.added_step_s is None:
            return None
        return round(self.baseline_step_s + self.added_step_s, 6)

    def status(self) -> dict[str, Any]:
        """What ``dynprof ps --json`` shows (plain data)."""
        return {
            "asked": self.spec,
            "state": self.state,
            "detail": self.detail,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "modules": list(self.modules),
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "verified_peak_bytes": self.verified_peak_bytes,
            "verified_peak_source": self.verified_peak_source or None,
            "floor_bytes": self.floor_bytes,
            "baseline_step_s": self.baseline_step_s,
            "predicted_step_s": self.predicted_step_s(),
            "verified_step_s": self.verified_step_s,
            "wrapped_from_step": self.wrapped_from_step,
            "rounds": self.rounds,
            "refused": list(self.refused),
            "notes": list(self.notes),
            "artifact": self.artifact or None,
        }

    def request_undo(self) -> str:
        """The server thread asks for the wrappers back: ``pending`` (done at the next step
        boundary), ``undone``, or ``nothing`` (nothing is wrapped and nothing will be)."""
        with self._lock:
            if self.state == "undone":
                return "undone"
            if self.state in FINAL and not self._wrapped:
                return "nothing"
            self._undo_requested = True
            self.detail = "the wrappers are taken back at the next step boundary"
            self.agent.steps.add_listener(self._listener)
            return "pending"

    # -- the training thread ---------------------------------------------------------------------
    def _on_step(self, count: int) -> None:
        with self._lock:
            self._count = count
            try:
                self._step()
            except Exception as exc:
                log.exception("checkpoint: failed")
                self._take_back()
                self._final("failed", f"{type(exc).__name__}: {exc}; the job runs as it was")

    def _step(self) -> None:
        if self._undo_requested:
            self._undo_requested = False
            n = self._take_back()
            self._final("undone", f"{n} block(s) run their own forward again" if n else "nothing was wrapped")
            return
        if self._undo_reason:
            reason, self._undo_reason = self._undo_reason, ""
            self._take_back()
            self._final("unreachable", reason)
            return
        state = self.state
        if state == "waiting":
            self._own_step()
            if self.boundaries >= WARMUP_BOUNDARIES - BLOCK_TIMED_STEPS:
                self._begin()
        elif state == "measuring" and self._timer is not None:
            self._own_step()  # the timer's hooks cost the step next to nothing: still the baseline
            self._timer.boundary()
            if self._timer.steps >= BLOCK_TIMED_STEPS:
                self._timer.stop()
                self._timed, self._timer = self._timer, None  # plain data now, for the planning thread
                self._measure()
        elif state == "measuring":
            measurement, self._measurement = self._measurement, None
            measurement.stop()
            measurement.freeze()
            self.state, self.detail = "planning", "planning from the measured step"
            self._plan_in_thread(measurement, None)
        elif state == "ready":
            self._apply()
        elif state == "verifying":
            self._verify()
        elif state == "timing":
            now = time.perf_counter()
            self._times.append(now - self._last_t)
            self._last_t = now
            if len(self._times) >= TIMED_STEPS:
                times = sorted(self._times)
                self.verified_step_s = round(times[len(times) // 2], 6)
                self._final("applied", self._summary())

    def _begin(self) -> None:
        from collectors.memory.plan.capture import StepMeasurement

        planner = getattr(getattr(self.agent, "memory", None), "planner", None)
        tracing = getattr(getattr(self.agent, "trace", None), "state", "")
        if planner is not None and planner.measuring():
            self.detail = "a memory plan measurement is under way; the next step is measured"
            return
        if tracing in ("armed", "tracing"):
            self.detail = busy_with_trace(tracing)[0] + "; the step after the trace is measured"
            return
        steps = self.agent.steps
        optimizers = [o for o in (r() for r in list(steps.optimizers.values())) if o is not None]
        roots = find_models(optimizers) if optimizers else []
        if not roots:
            why = "no nn.Module holds the optimizers' parameters, so the model cannot be seen"
            if "deepspeed" in sys.modules:
                why += " (DeepSpeed's ZeRO optimizer steps flattened partitions, not the model's parameters)"
            self._final("refused", why + "; nothing is wrapped")
            return
        try:
            measurement = StepMeasurement(roots, optimizers, on_end=self._ended)
        except MeasurementRefused as exc:
            self._final("refused", f"the step cannot be measured right: {exc}; nothing is wrapped")
            return
        self.notes = list(measurement.notes)
        if self.spec == "auto":
            self.budget_bytes, self.budget_source = _auto_budget(roots)
        del roots, optimizers
        self._measurement = measurement
        # the blocks' plain forward first (the recompute cost), then the measured step
        typical = self.agent.steps.typical_step_s()
        self._timer = BlockTimer(
            measurement.blocks,
            cuda=on_cuda(measurement.blocks),
            time_limit_s=step_time_limit(typical),
            on_end=self._timer_ended,
        )
        self.state, self.detail = "measuring", f"timing the blocks' forward in {BLOCK_TIMED_STEPS} steps"
        self._timer.start()

    def _own_step(self) -> None:
        """A boundary of the job's own steps: its interval kept for the baseline."""
        now = time.perf_counter()
        if self._last_t:
            self._times.append(now - self._last_t)
        self._last_t = now
        self.boundaries += 1

    def _measure(self) -> None:
        """The measured step begins (the baseline is the job's steps before it)."""
        own = sorted(self._times[BASELINE_SKIP:])
        typical = own[len(own) // 2] if own else self.agent.steps.typical_step_s()
        self._times = []
        self.baseline_step_s = round(typical, 6) if typical else None
        measurement = self._measurement
        measurement.time_limit_s = step_time_limit(typical)
        self.detail = "measuring one step"
        measurement.start()

    def _timer_ended(self, why: str) -> None:
        # the blocks' timer ended itself inside one of its hooks (training thread), hooks off
        with self._lock:
            self._timer = None
            measurement, self._measurement = self._measurement, None
            if measurement is not None:
                measurement.release()
            if self.state == "measuring":
                self._final("failed", f"the steps timed before the measured one did not end: {why}; nothing is wrapped")

    def _ended(self, why: str) -> None:
        # the measurement ended itself inside one of its hooks (training thread)
        with self._lock:
            self._measurement = None
            if self.state == "measuring":
                self._final("failed", f"the measured step did not end: {why}; nothing is wrapped")

    def _apply(self) -> None:

        chosen = self._pending or []
        self._pending = None
        optimizers = [o for o in (r() for r in list(self.agent.steps.optimizers.values())) if o is not None]
        roots = find_models(optimizers) if optimizers else []
        blocks = blocks_by_name(roots)
        have = {w.name for w in self._wrapped}
        refused: list[str] = []
        for name in chosen:
            if name in have:
                continue
            found = blocks.get(name)
            if found is None:
                refused.append(f"block {name} is no longer in the model")
                continue
            why = why_not_wrap(name, found[0], found[1])
            if why:
                refused.append(why)
        if refused:
            self.refused = refused
            self._take_back()
            self._final("refused", "; ".join(refused) + "; nothing is wrapped, the job runs as it was")
            return
        for name in chosen:
            if name not in have:
                self._wrapped.append(wrap(name, blocks[name][0]))
        self.modules = [w.name for w in self._wrapped]
        if self.wrapped_from_step is None:
            self.wrapped_from_step = self._count
        device = (self.measurement_doc or {}).get("device") or "cpu"
        peak = StepPeak(known_tensors(roots, optimizers), str(device))
        del roots, optimizers, blocks
        peak.start()
        self._peak = peak
        self.state, self.detail = "verifying", f"reading the peak of the first step with {len(self.modules)} block(s)"
        log.info("checkpoint: %d block(s) wrapped: %s", len(self.modules), ", ".join(self.modules[:32]))

    def _verify(self) -> None:
        peak, self._peak = self._peak, None
        peak.stop()
        self.verified_peak_bytes = int(peak.bytes)
        self.verified_peak_source = peak.source
        budget = self.budget_bytes or 0
        predicted = self.predicted_peak_bytes or 0
        if self.verified_peak_bytes > budget:
            if self.rounds >= MAX_ROUNDS:
                self._take_back()
                self._final(
                    "unreachable",
                    f"after {self.rounds} more plan(s) the peak is still {human_bytes(self.verified_peak_bytes)}, over the "
                    f"budget {human_bytes(budget)}; every wrapper is taken back, the job runs as it was",
                )
                return
            self.rounds += 1
            missed = max(1, self.verified_peak_bytes - predicted)
            self.state = "planning"
            self.detail = (
                f"the peak was {human_bytes(self.verified_peak_bytes)}, {human_bytes(missed)} over the prediction: planning for "
                f"{human_bytes(budget - missed)}"
            )
            log.info("checkpoint: %s", self.detail)
            self._plan_in_thread(None, budget - missed)
            return
        self.state, self.detail = "timing", f"timing {TIMED_STEPS} steps"
        self._times = []
        self._last_t = time.perf_counter()

    def _take_back(self) -> int:
        """Every wrapper off, the measurement and the peak reading stopped (training thread)."""
        wrapped, self._wrapped = self._wrapped, []
        n = sum(1 for w in wrapped if w.undo())
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()
        measurement, self._measurement = self._measurement, None
        if measurement is not None:
            measurement.stop()
        peak, self._peak = self._peak, None
        if peak is not None:
            peak.stop()
        if wrapped:
            self.modules = []
            log.info("checkpoint: %d block(s) run their own forward again", n)
        return n

    def _final(self, state: str, detail: str) -> None:
        self.state, self.detail = state, detail
        self.agent.steps.remove_listener(self._listener)
        log.info("checkpoint %s: %s", state, detail)
        try:
            sys.stderr.write(f"dynprof: checkpoint {self.spec}: {state}: {detail}\n")
        except Exception:
            pass
        if self.measurement_doc is not None:
            threading.Thread(target=self._save, name="dynprof-checkpoint-save", daemon=True).start()

    def _summary(self) -> str:
        p, v = self.predicted_peak_bytes or 0, self.verified_peak_bytes or 0
        text = (
            f"{len(self.modules)} block(s) recomputed in backward ({', '.join(self.modules[:8])}"
            f"{' ...' if len(self.modules) > 8 else ''}): peak {human_bytes(v)} ({self.verified_peak_source}), predicted "
            f"{human_bytes(p)}, budget {human_bytes(self.budget_bytes or 0)}"
        )
        predicted_s = self.predicted_step_s()
        if self.verified_step_s is not None and predicted_s:
            text += f"; step {self.verified_step_s * 1000:.1f} ms, predicted {predicted_s * 1000:.1f} ms"
        return text

    # -- the agent's planning thread: plain data only ----------------------------------------------
    def _plan_in_thread(self, measurement: Any, budget: int | None) -> None:
        threading.Thread(
            target=self._plan, args=(measurement, budget), name="dynprof-checkpoint-plan", daemon=True
        ).start()

    def _plan(self, measurement: Any, budget: int | None) -> None:
        from collectors.memory.plan.solve import make_plan

        try:
            if measurement is not None:
                timer, self._timed = self._timed, None
                if timer is not None:
                    apply_timer(measurement, timer)
                doc = measurement.result()  # plain data since freeze(); on CUDA waits for dynprof's events
                doc["typical_step_s"] = self.baseline_step_s
                self.measurement_doc = doc
                planner = getattr(getattr(self.agent, "memory", None), "planner", None)
                if planner is not None:
                    planner.last_measurement = doc  # for the advice at an OOM
            m = from_json(self.measurement_doc)
            self.measured_peak_bytes = m.peak_bytes
            if self.budget_bytes is None:
                size, fraction = parse_budget(self.spec)
                self.budget_bytes = size if size is not None else int(m.peak_bytes * (fraction or 0))
                self.budget_source = self.spec
            plan = make_plan(m, budget=budget if budget is not None else self.budget_bytes)
            self.floor_bytes = plan.get("floor_bytes")
            with self._lock:
                if self.state != "planning":
                    return  # taken back meanwhile
                self.plan_doc = plan
                if plan["status"] == "fits-already" and not self._wrapped:
                    self.predicted_peak_bytes = m.peak_bytes
                    self._final(
                        "fits-already",
                        f"the measured peak {human_bytes(m.peak_bytes)} is under the budget {human_bytes(self.budget_bytes or 0)} "
                        f"({self.budget_source}): nothing to recompute, nothing is wrapped",
                    )
                    return
                chosen = (plan.get("plan") or {}).get("modules") or []
                if plan["status"] == "unreachable" or (self._wrapped and not chosen):
                    reason = (
                        f"no set of blocks brings the peak under {human_bytes(budget or self.budget_bytes or 0)}: the least "
                        f"recomputation reaches is {human_bytes(plan['floor_bytes'])}"
                    )
                    if self._wrapped:
                        self._undo_reason = reason + "; every wrapper is taken back, the job runs as it was"
                        self.state = "undo-pending"
                    else:
                        self._final("unreachable", reason + "; nothing is wrapped, the job runs as it was")
                    return
                self.predicted_peak_bytes = int(plan["plan"]["predicted_peak_bytes"])
                self.added_step_s = float(plan["plan"]["added_step_s"])
                self._pending = list(chosen)
                self.state = "ready"
                self.detail = f"{len(chosen)} block(s) chosen; wrapped at the next step boundary"
        except Exception as exc:
            log.exception("checkpoint: planning failed")
            with self._lock:
                if self._wrapped:
                    self._undo_reason = f"planning failed ({type(exc).__name__}: {exc}); every wrapper is taken back"
                    self.state = "undo-pending"
                else:
                    self._final("failed", f"planning failed: {type(exc).__name__}: {exc}; nothing is wrapped")

    def _save(self) -> None:
        """Keep the measurement, the budget and what was verified as a ``memory-plan`` artifact."""
        from collectors.memory.plan.render import KIND, PLAN_FILE

        try:
            ident = self.agent.identity
            status = self.status()
            writer = ArtifactStore().create(
                KIND,
                job=ident.job_id,
                host=ident.host,
                rank=ident.rank,
                pid=self.agent.pid,
                options={"checkpoint": self.spec},
            )
            with writer:
                writer.write_json(
                    PLAN_FILE,
                    {
                        "schema": 1,
                        "measurement": self.measurement_doc,
                        "asked": {"budget_bytes": self.budget_bytes or 0},
                        "applied": status,
                    },
                )
                self.artifact = str(writer.finish("complete", summary={"checkpoint": status}).path)
            log.info("checkpoint: kept as %s", self.artifact)
        except Exception:
            log.exception("checkpoint: the memory-plan artifact was not written")

    def at_exit(self) -> None:
        with self._lock:
            self.agent.steps.remove_listener(self._listener)
            for obj in (self._measurement, self._peak):
                if obj is not None:
                    try:
                        obj.stop()
                    except Exception:
                        log.exception("checkpoint: stopping at exit failed")
            self._measurement = self._peak = None


def _auto_budget(roots: list[Any]) -> tuple[int, str]:
    """``auto``'s budget for the device of the models' parameters (training thread)."""
    device = "cpu"
    for root in roots:
        for p in root.parameters():
            device = str(p.device)
            break
        break

    def host_limit() -> int:
        from collectors import host_memory

        return int(host_memory.resolve_limit(None, host_memory.find_cgroup()).bytes)

    return auto_budget(device, host_limit)


def install(agent: Agent, environ: Any) -> CheckpointApplier | None:
    """The applier of a job that asked (``DYNPROF_CHECKPOINT``), started; None for any other."""
    raw = str(environ.get(ENV, "") or "").strip()
    if not raw or raw.lower() in ("0", "off", "no", "false"):
        return None
    try:
        spec = parse_spec(raw)
    except ValueError as exc:
        log.warning("%s=%r: %s; the job runs without checkpointing", ENV, raw[:MAX_SPEC], exc)
        return None
    applier = CheckpointApplier(agent, spec)
    applier.start()
    return applier
