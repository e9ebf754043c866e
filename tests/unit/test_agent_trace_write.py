"""Writing a trace and the job's exit (dynprof/agent/_trace_write.py): an armed trace at the
exit says it never started, the exit's wait is read from the environment and falls back to its
default with a warning, and a trace being written is finished by one side only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch  # noqa: F401  (the controller traces PyTorch code: torch is imported in the job)

from dynprof.agent import _trace, _trace_write
from dynprof.proto import pb
from tests.support.trace_controller import idle_controller


@pytest.fixture
def controller(monkeypatch: pytest.MonkeyPatch) -> Iterator[_trace.TraceController]:
    found = idle_controller(monkeypatch)
    yield found
    found._cancel_timers()


def test_the_exit_of_a_process_with_an_armed_trace_says_it_never_started(controller):
    # GIVEN an armed trace
    controller.handle_start(pb.StartTraceRequest(steps=1, at_step=1000))

    # WHEN the job exits
    controller.at_exit()

    # THEN the controller is idle, and the reason is recorded
    assert controller.state == "idle" and "exited before the trace started" in controller.last_error


@pytest.mark.parametrize("text", ["abc", "-1", "nan", str(_trace_write.MAX_EXIT_WAIT_S + 1)])
def test_a_bad_exit_wait_setting_falls_back_to_the_default_with_a_warning(monkeypatch, caplog, text):
    # GIVEN a setting that is no duration in range
    monkeypatch.setenv("DYNPROF_TRACE_EXIT_WAIT_S", text)

    # WHEN read
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        value = _trace_write.exit_wait_s()

    # THEN the default, and a warning naming the variable
    assert value == _trace_write.DEFAULT_EXIT_WAIT_S
    assert "DYNPROF_TRACE_EXIT_WAIT_S" in caplog.text


def test_an_exit_wait_setting_in_range_is_used(monkeypatch):
    # GIVEN 0 (do not wait) and 12.5 s
    monkeypatch.setenv("DYNPROF_TRACE_EXIT_WAIT_S", "0")
    assert _trace_write.exit_wait_s() == 0.0
    monkeypatch.setenv("DYNPROF_TRACE_EXIT_WAIT_S", " 12.5 ")
    assert _trace_write.exit_wait_s() == 12.5


def test_an_export_is_finished_by_whoever_claims_it_first():
    # GIVEN a trace being written
    export = _trace_write.TraceExport()

    # WHEN the export thread claims it, then the job's exit tries to
    # THEN the first claim wins and is kept; the other is refused
    assert export.claim("export") is True
    assert export.claim("exit") is False
    assert export.claim("export") is True and export.owner == "export"
