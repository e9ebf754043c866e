"""dynprof.onmain: a call handed to the main thread, waited for a bounded time, never run late."""

from __future__ import annotations

import threading

import pytest

from dynprof.onmain import NotRun, call_on_main


def _from_another_thread(fn):
    """``fn()`` on a thread of its own: (its value, or the exception it raised)."""
    got: list = []

    def run():
        try:
            got.append(fn())
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, got


def _queue():
    queued: list = []

    def call_soon(task):
        queued.append(task)
        return True

    return queued, call_soon


def _until(cond):
    while not cond():
        threading.Event().wait(0.005)


def test_the_call_runs_on_the_main_thread_and_its_value_comes_back():
    # GIVEN a waiter on another thread and this (main) thread draining the queue as CPython would
    queued, call_soon = _queue()
    ran_on: list = []

    def fn():
        ran_on.append(threading.current_thread() is threading.main_thread())
        return 42

    t, got = _from_another_thread(lambda: call_on_main(call_soon, fn, 60))
    _until(lambda: queued)
    queued.pop()()
    t.join(60)
    # THEN it ran here, once, and the waiter has its value
    assert ran_on == [True] and got == [42]


def test_on_the_main_thread_itself_the_call_runs_at_once_without_the_queue():
    assert call_on_main(lambda task: pytest.fail("queued"), lambda: "here", 0) == "here"


def test_a_call_not_begun_by_the_deadline_is_cancelled_and_never_runs_late():
    # GIVEN a main thread that runs no pending call (inside a long C call)
    queued, call_soon = _queue()
    ran: list = []
    t, got = _from_another_thread(lambda: call_on_main(call_soon, lambda: ran.append(1), 0.01))
    t.join(60)
    # WHEN the main thread later runs what was queued
    for task in queued:
        task()
    # THEN the waiter was told why, and the call did not run
    assert isinstance(got[0], NotRun) and "ran no Python within 0.01 s" in str(got[0])
    assert ran == []


def test_a_call_begun_before_the_deadline_is_waited_for_to_its_end():
    # GIVEN a call that the main thread begins in time and that runs past the deadline
    queued, call_soon = _queue()
    t, got = _from_another_thread(
        lambda: call_on_main(call_soon, lambda: (threading.Event().wait(0.3), "done")[1], 0.05)
    )
    _until(lambda: queued)
    queued.pop()()
    t.join(60)
    # THEN its value is not lost
    assert got == ["done"]


def test_the_calls_exception_is_raised_to_the_waiter():
    queued, call_soon = _queue()

    def fn():
        raise ValueError("bad read")

    t, got = _from_another_thread(lambda: call_on_main(call_soon, fn, 60))
    _until(lambda: queued)
    queued.pop()()
    t.join(60)
    assert isinstance(got[0], ValueError) and str(got[0]) == "bad read"


def test_a_full_queue_and_a_waiter_that_gives_up_are_said_in_words():
    # a queue that refuses the call
    t, got = _from_another_thread(lambda: call_on_main(lambda task: False, lambda: 1, 60))
    t.join(60)
    assert isinstance(got[0], NotRun) and "queue of pending calls was full" in str(got[0])
    # a waiter whose give_up() turns true long before its deadline: cancelled, never run
    queued, call_soon = _queue()
    stop = threading.Event()
    ran: list = []
    t, got = _from_another_thread(lambda: call_on_main(call_soon, lambda: ran.append(1), 3600, give_up=stop.is_set))
    _until(lambda: queued)
    stop.set()
    t.join(60)
    queued.pop()()
    assert isinstance(got[0], NotRun) and "given up" in str(got[0]) and ran == []
