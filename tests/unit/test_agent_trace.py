"""The agent's trace controller (dynprof/agent/_trace.py), its requests and states without a
profiler started: bounds on what a start may ask, one trace at a time, an armed trace that a
stop or the cap ends leaves the agent idle and saying why, and the settings read from the
environment fall back to their defaults with a warning."""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch  # noqa: F401  (the controller traces PyTorch code: torch is imported in the job)

from dynprof.agent import _trace
from dynprof.agent._server import CommandError
from dynprof.proto import pb
from tests.support.trace_controller import idle_controller


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> Iterator[_trace.TraceController]:
    found = idle_controller(monkeypatch)
    yield found
    found._cancel_timers()


def _refused(controller: _trace.TraceController, **request: Any) -> CommandError:
    with pytest.raises(CommandError) as info:
        controller.handle_start(pb.StartTraceRequest(**request))
    assert controller.state == "idle", "a refused request leaves the controller idle"
    return info.value


def test_steps_and_duration_together_are_refused(controller):
    # WHEN both bounds are given THEN the request is refused as invalid
    assert _refused(controller, steps=2, duration_s=1.0).code == pb.INVALID_ARGUMENT


@pytest.mark.parametrize("field", ["duration_s", "max_duration_s"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, _trace.MAX_DURATION_LIMIT_S * 2])
def test_durations_out_of_range_are_refused(controller, field, value):
    # WHEN a duration or cap is negative, not finite or over a week THEN it is refused, named
    error = _refused(controller, **{field: value})
    assert error.code == pb.INVALID_ARGUMENT and "out of range" in error.message


def test_too_many_steps_or_too_late_a_step_are_refused(controller):
    # WHEN the step count or start step is past its bound THEN refused
    assert _refused(controller, steps=_trace.MAX_STEPS + 1).code == pb.INVALID_ARGUMENT
    assert _refused(controller, steps=1, at_step=2**63).code == pb.INVALID_ARGUMENT


def test_a_start_step_that_has_passed_is_refused_with_where_the_process_is(controller):
    # GIVEN a process at step 10
    # WHEN asked to start at step 5
    error = _refused(controller, steps=2, at_step=5)

    # THEN refused, naming both steps
    assert error.code == pb.STEP_PASSED and "step 5" in error.message and "step 10" in error.message


def test_a_step_trace_without_the_step_hook_is_refused_and_duration_suggested(controller):
    # GIVEN a process whose torch.optim is not imported yet
    controller.steps.hook_installed = False

    # WHEN asked for a step-mode trace
    error = _refused(controller, steps=2)

    # THEN refused as unsupported, with the duration mode named
    assert error.code == pb.UNSUPPORTED and "--duration" in error.help


def test_a_process_without_torch_is_refused(controller, monkeypatch):
    # GIVEN a process that never imported torch (a launcher)
    monkeypatch.delitem(__import__("sys").modules, "torch")

    # THEN a trace is refused, saying why
    assert _refused(controller, steps=2).code == pb.NO_TORCH


def test_a_step_trace_is_armed_for_a_later_step_and_a_second_start_is_busy(controller):
    # WHEN a 3-step trace is asked for at step 20
    field, reply = controller.handle_start(pb.StartTraceRequest(steps=3, at_step=20, group_id="g1"))

    # THEN it is armed, waiting for step 20, and listens to step boundaries
    assert field == "trace_started" and reply.trace.state == "armed"
    assert (reply.trace.start_step, reply.trace.steps, reply.trace.group_id) == (20, 3, "g1")
    assert controller._on_boundary in controller.steps._listeners

    # WHEN another start comes meanwhile THEN it is refused as busy, naming the group
    error = _refused_while_armed(controller)
    assert error.code == pb.BUSY and "g1" in error.message


def _refused_while_armed(controller: _trace.TraceController) -> CommandError:
    with pytest.raises(CommandError) as info:
        controller.handle_start(pb.StartTraceRequest(steps=1))
    assert controller.state == "armed"
    return info.value


def test_a_stop_before_the_start_step_cancels_the_trace(controller):
    # GIVEN an armed trace
    controller.handle_start(pb.StartTraceRequest(steps=3, at_step=20))

    # WHEN stopped before its step
    field, reply = controller.handle_stop(pb.StopTraceRequest())

    # THEN it is idle again, with the cancellation as its last outcome and no timer left
    assert field == "trace_stopped" and reply.trace.state == "idle"
    assert controller.last_status == "failed" and "cancelled" in controller.last_error
    assert controller._timers == []


def test_a_cancelled_trace_leaves_no_listener_on_the_step_hook(controller):
    # GIVEN an armed trace, cancelled
    controller.handle_start(pb.StartTraceRequest(steps=3, at_step=20))
    controller.handle_stop(pb.StopTraceRequest())

    # THEN the step hook is back on its idle path: no listener
    assert controller.steps._listeners == ()


def test_a_stop_with_nothing_running_is_an_error(controller):
    # WHEN stopped while idle THEN refused as not running
    with pytest.raises(CommandError) as info:
        controller.handle_stop(pb.StopTraceRequest())
    assert info.value.code == pb.NOT_RUNNING


def test_an_armed_trace_that_never_reaches_its_step_ends_at_the_cap(controller, caplog):
    # GIVEN an armed trace waiting for a step that never comes
    controller.handle_start(pb.StartTraceRequest(steps=1, at_step=1000))

    # WHEN the cap fires
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        controller._on_cap()

    # THEN nothing was traced, the controller is idle and says why (step mode: --duration advised)
    assert controller.state == "idle" and controller.session is None
    assert "step 1000" in controller.last_error and "--duration" in controller.last_error
    assert controller.state_pb().last_error == controller.last_error


def test_a_bad_trace_cap_setting_falls_back_to_600_s(monkeypatch):
    # GIVEN a cap that is no duration, and one that is
    monkeypatch.setenv("DYNPROF_TRACE_MAX_S", "-5")
    assert _trace._default_max_duration() == 600.0
    monkeypatch.setenv("DYNPROF_TRACE_MAX_S", "30")
    assert _trace._default_max_duration() == 30.0


def test_an_unaligned_start_that_finds_no_safe_point_also_starts_at_the_next_boundary(controller, monkeypatch):
    # GIVEN a duration trace armed while steps do not flow (it starts where the main thread is)
    retries: list[Any] = []
    monkeypatch.setattr(_trace, "call_soon_in_main_thread", lambda fn: True)  # queued, run by hand
    monkeypatch.setattr(controller, "_retry_on_main_thread", retries.append)
    controller.handle_start(pb.StartTraceRequest(duration_s=1.0))
    assert controller.state == "armed" and not controller._aligned
    began: list[int | None] = []
    monkeypatch.setattr(controller, "_begin", lambda first_step: began.append(first_step) or False)

    # WHEN the main thread's attempt finds no safe point (it landed in backward, say)
    controller._start_at_safe_point()

    # THEN it retries there, and the next step boundary listens for it too
    assert retries == [controller._start_at_safe_point]
    assert controller._on_boundary in controller.steps._listeners

    # WHEN that boundary comes and is safe
    def begin(first_step: int | None) -> bool:
        began.append(first_step)
        controller.state = "tracing"
        return True

    monkeypatch.setattr(controller, "_begin", begin)
    controller._on_boundary(11)

    # THEN the trace starts there, after step 11, its first span a whole step
    assert began[-1] == 12 and controller._first_partial is False
    assert retries == [controller._start_at_safe_point]  # no second retry chain


def _tracing(controller: _trace.TraceController, monkeypatch: pytest.MonkeyPatch, *, aligned: bool) -> list[float]:
    """The controller as while a trace runs (no profiler): its timers recorded, not started."""
    controller.state = "tracing"
    controller.session = types.SimpleNamespace(thread_id=-1, stop_requested_at=0.0)  # type: ignore[assignment]
    controller._aligned = aligned
    monkeypatch.setattr(controller, "_steps_flowing", lambda: True)
    timers: list[float] = []
    monkeypatch.setattr(controller, "_timer", lambda seconds, fn: timers.append(seconds))
    return timers


def test_a_stop_that_finds_no_boundary_in_its_grace_says_so_in_the_manifest(controller, monkeypatch):
    # GIVEN a trace that started at a step boundary, its steps flowing
    timers = _tracing(controller, monkeypatch, aligned=True)
    # WHEN it is asked to stop: it waits for the next boundary, at most its grace
    controller._request_stop("duration")
    assert timers == [_trace.STOP_GRACE_MIN_S]  # no typical step yet: the floor
    # THEN a stop at that boundary has a whole last span and no reason given
    at_boundary = controller._span_fields(at_boundary=True)
    assert at_boundary["last_span_partial"] is False and at_boundary["last_span_partial_why"] == ""
    # AND one where none came in time says so, with the grace it waited
    partial = controller._span_fields(at_boundary=False)
    assert partial["last_span_partial"] is True
    assert "no step boundary came within 0.5 s of the stop" in partial["last_span_partial_why"]


def test_a_stop_of_an_unaligned_trace_says_why_its_last_span_is_partial(controller, monkeypatch):
    # GIVEN a trace that did not start at a step boundary
    timers = _tracing(controller, monkeypatch, aligned=False)
    # WHEN it is asked to stop: no grace is waited (its spans were never aligned)
    controller._request_stop("duration")
    assert timers == []
    # THEN its last span's reason names the start
    why = controller._span_fields(at_boundary=False)["last_span_partial_why"]
    assert "did not start at a step boundary" in why


def test_a_trace_being_written_says_since_when_and_how_long_it_recorded(controller):
    from types import SimpleNamespace

    # GIVEN a trace that recorded 40 s and is being written
    controller.state = "exporting"
    controller.session = SimpleNamespace(started_at=1000.0, stopped_at=1040.0)
    # WHEN its state is asked
    state = controller.state_pb()
    # THEN it says when the write began and how long the trace recorded
    assert state.state == "exporting" and state.ending_since == 1040.0 and state.profiled_s == 40.0
    # and an idle agent says neither
    controller.state, controller.session = "idle", None
    assert controller.state_pb().ending_since == 0.0 and controller.state_pb().profiled_s == 0.0


@pytest.mark.parametrize("measuring", ["armed", "measuring"])
def test_a_trace_is_refused_while_a_memory_plan_measures_a_step(controller, measuring):
    # GIVEN a memory plan measurement waiting for (or running) its step in this process
    planner = types.SimpleNamespace(measuring=lambda: measuring)
    controller.agent.memory = types.SimpleNamespace(planner=planner)  # type: ignore[attr-defined]
    # WHEN a trace is asked for THEN it is busy, saying why a trace of that step would mislead
    error = _refused(controller, steps=3)
    assert error.code == pb.BUSY and f"a memory plan measurement is {measuring}" in error.message
    assert "each operator twice" in error.message and "ask again" in error.help
    # AND once the measurement has ended, the trace starts
    planner.measuring = lambda: ""
    field, reply = controller.handle_start(pb.StartTraceRequest(steps=3))
    assert field == "trace_started" and reply.trace.state == "armed"
