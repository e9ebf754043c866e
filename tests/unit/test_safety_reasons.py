"""The trace decides on the kind of unsafe moment `_safety` names, never on its wording."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dynprof.agent import _safety, _trace
from dynprof.agent._safety import WATCH, UnsafeReason, unsafe_reason


class _Steps:
    optimizer_steps = 0

    def remove_listener(self, listener: Any) -> None:
        pass


@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch) -> _trace.TraceController:
    monkeypatch.setattr(WATCH, "on_foreign_prepare", WATCH.on_foreign_prepare)  # restored after the test
    controller = _trace.TraceController(SimpleNamespace(steps=_Steps()))  # type: ignore[arg-type]
    controller.state = "armed"
    return controller


def test_another_profiler_is_named_by_its_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the job's own profiler recording
    monkeypatch.setattr(_safety, "other_profiler_active", lambda: True)
    # WHEN a start asks whether it may start the profiler here
    reason = unsafe_reason()
    # THEN the answer is the kind, with its text for the log
    assert reason is UnsafeReason.OTHER_PROFILER
    assert reason.text == "another torch.profiler is active"


def test_an_armed_trace_refuses_when_another_profiler_is_active(
    monkeypatch: pytest.MonkeyPatch, armed: _trace.TraceController
) -> None:
    # GIVEN an armed trace, and the safety check naming another profiler
    monkeypatch.setattr(_trace, "unsafe_reason", lambda **_: UnsafeReason.OTHER_PROFILER)
    # WHEN the start step arrives
    done = armed._begin_unguarded(first_step=None)
    # THEN the trace ends at once, failed with the profiler-active error
    assert done is True
    assert armed.state == "idle"
    assert armed.last_status == "failed"
    assert armed.last_error == "a torch.profiler started by the job is already active in this process"


@pytest.mark.parametrize("reason", [UnsafeReason.BACKWARD, UnsafeReason.COMPILED, UnsafeReason.DISPATCH])
def test_an_armed_trace_waits_at_any_other_unsafe_moment(
    monkeypatch: pytest.MonkeyPatch, armed: _trace.TraceController, reason: UnsafeReason
) -> None:
    # GIVEN an armed trace whose start step lands somewhere unsafe
    monkeypatch.setattr(_trace, "unsafe_reason", lambda **_: reason)
    # WHEN the start step arrives
    done = armed._begin_unguarded(first_step=None)
    # THEN it waits for a safe point, still armed
    assert done is False
    assert armed.state == "armed"
