"""healthcheck.timeouts: a call with a time limit in an abandoned daemon thread, and the record
of which call each thread is in."""

from __future__ import annotations

import threading

import pytest

from healthcheck.timeouts import PROBE_TIMEOUT_S, Call, InFlight, TimedOut, call_with_timeout, did_not_return


def test_a_call_that_returns_in_time_gives_its_value():
    assert call_with_timeout(lambda: 42, timeout=5) == 42


def test_the_callers_exception_is_raised_to_the_caller():
    # GIVEN a call that raises
    def boom():
        raise ValueError("bad reading")

    # WHEN its result is asked for
    # THEN the same exception reaches the caller, not a TimedOut
    with pytest.raises(ValueError, match="bad reading"):
        call_with_timeout(boom, timeout=5)


def test_a_call_that_overruns_raises_timed_out_and_is_abandoned():
    # GIVEN a call blocked on an event that is set only after the caller gave up
    release = threading.Event()
    call = Call(lambda: release.wait(5) and "late", name="probe-under-test")
    try:
        # WHEN the caller waits a short time
        with pytest.raises(TimedOut) as info:
            call.result(0.05)
        # THEN it says how long it waited, and the call is still running
        assert info.value.seconds == 0.05
        assert str(info.value) == "timed out after 0.05 s"
        assert call.done is False
    finally:
        release.set()
    # AND once released, the abandoned call finishes and its value can still be read
    assert call.result(5) == "late"
    assert call.done is True


def test_the_call_runs_in_a_daemon_thread_whose_id_is_known():
    seen: list[tuple[int, bool]] = []

    def fn():
        t = threading.current_thread()
        seen.append((threading.get_ident(), t.daemon))

    call = Call(fn)
    call.result(5)
    assert seen == [(call.thread_id, True)], "a daemon thread does not keep the interpreter alive"


def test_base_exceptions_are_carried_too():
    def leave():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Call(leave).result(5)


def test_did_not_return_names_the_call_and_the_limit():
    assert did_not_return("NVML call nvmlDeviceGetPcieReplayCounter", 10.0) == (
        "NVML call nvmlDeviceGetPcieReplayCounter did not return in 10 s"
    )
    assert did_not_return("x", 2.5).endswith("in 2.5 s")


def test_in_flight_names_the_call_of_each_thread_until_it_leaves():
    # GIVEN a thread that entered a call and waits there
    flight = InFlight()
    entered, release = threading.Event(), threading.Event()

    def worker():
        flight.enter("nvmlDeviceGetHandleByIndex")
        entered.set()
        release.wait(5)
        flight.leave()

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert entered.wait(5)
        # WHEN asked which call that thread is in
        # THEN the name is given; this thread is in none
        assert flight.of(t.ident) == "nvmlDeviceGetHandleByIndex"
        assert flight.of(threading.get_ident()) is None
    finally:
        release.set()
        t.join(5)
    # AND after it left, it is in none
    assert flight.of(t.ident) is None


def test_in_flight_of_no_thread_is_none_and_leave_without_enter_is_harmless():
    flight = InFlight()
    flight.leave()
    assert flight.of(None) is None


def test_a_second_enter_replaces_the_first_name():
    flight = InFlight()
    flight.enter("first")
    flight.enter("second")
    assert flight.of(threading.get_ident()) == "second"


def test_the_default_probe_limit_is_ten_seconds():
    # The message in the module's docstring ("did not return in 10 s") depends on it.
    assert PROBE_TIMEOUT_S == 10.0
