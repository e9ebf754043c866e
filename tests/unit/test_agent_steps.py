"""Optimizer-step counting (dynprof/agent/_steps.py): one step per training iteration whatever
the number of optimizers, a replaced optimizer going on from the count, listeners called at the
boundary only (a failing one removed, never raising into the step), compiled steps folded once,
the hook installed when torch.optim is imported and gone at uninstall, and the frame-return wait
that boundaries use."""

from __future__ import annotations

import gc
import logging
import sys
import types

import pytest

from dynprof.agent import _steps
from dynprof.agent._steps import StepTracker


class _Opt:
    """An optimizer as the hook sees it (only its identity matters for counting)."""


class _NoGpu:
    def mark(self, torch, optimizer, step):
        pass


def _tracker() -> StepTracker:
    tracker = StepTracker()
    tracker.gpu = _NoGpu()  # type: ignore[assignment]
    return tracker


def test_one_optimizer_counts_each_of_its_steps():
    # GIVEN a tracker and one optimizer
    tracker, opt = _tracker(), _Opt()

    # WHEN it steps three times
    for _ in range(3):
        tracker._eager_step(opt)

    # THEN three steps, three optimizer steps, and the time of the last boundary is known
    assert (tracker.step, tracker.optimizer_steps) == (3, 3)
    assert tracker.last_step_at > 0 and tracker.last_progress_at == tracker.last_step_at


def test_two_optimizers_per_iteration_count_once_per_iteration():
    # GIVEN a GAN's two optimizers, each stepped once per iteration
    tracker, gen, disc = _tracker(), _Opt(), _Opt()

    # WHEN three iterations run
    for _ in range(3):
        tracker._eager_step(disc)
        tracker._eager_step(gen)

    # THEN three steps of six optimizer steps
    assert (tracker.step, tracker.optimizer_steps) == (3, 6)


def test_an_optimizer_that_replaces_a_dropped_one_goes_on_counting():
    # GIVEN an optimizer that stepped twice and was then dropped by the job (a second stage)
    tracker = _tracker()
    first = _Opt()
    tracker._eager_step(first)
    tracker._eager_step(first)
    del first
    gc.collect()

    # WHEN a new optimizer steps twice
    second = _Opt()
    tracker._eager_step(second)
    tracker._eager_step(second)

    # THEN the count goes on from 2: each of its steps is an iteration
    assert tracker.step == 4


def test_a_new_optimizer_that_steps_again_before_the_old_one_began_an_iteration():
    # GIVEN an optimizer that stepped twice, still referenced (the job keeps it)
    tracker, old, new = _tracker(), _Opt(), _Opt()
    tracker._eager_step(old)
    tracker._eager_step(old)

    # WHEN a new one steps (joining the iteration in progress) and steps again before `old` does
    tracker._eager_step(new)
    assert tracker.step == 2, "its first step joins the iteration in progress"
    tracker._eager_step(new)

    # THEN its first step is counted as an iteration after all, and the second as another
    assert tracker.step == 4


def test_listeners_are_called_at_each_boundary_with_the_step_and_only_then():
    # GIVEN a listener and two optimizers per iteration
    tracker, a, b = _tracker(), _Opt(), _Opt()
    seen: list[int] = []
    listener = seen.append
    tracker.add_listener(listener)
    tracker.add_listener(listener)  # added once only

    # WHEN two iterations run
    for _ in range(2):
        tracker._eager_step(a)
        tracker._eager_step(b)

    # THEN the listener saw each boundary once, with the step it ends
    assert seen == [1, 2]

    # WHEN it is removed and another iteration runs
    tracker.remove_listener(listener)
    tracker._eager_step(a)

    # THEN it sees nothing more
    assert seen == [1, 2] and tracker.step == 3


def test_a_listener_given_again_as_a_bound_method_is_removed():
    # GIVEN a listener that is a bound method, added once
    class Capture:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_boundary(self, step: int) -> None:
            self.seen.append(step)

    tracker, opt, capture = _tracker(), _Opt(), Capture()
    tracker.add_listener(capture.on_boundary)

    # WHEN it is removed the way it was added (the attribute read again: a new bound method)
    tracker.remove_listener(capture.on_boundary)
    tracker._eager_step(opt)

    # THEN it is gone: no listener is left on the hot path, and it saw nothing
    assert tracker._listeners == () and capture.seen == []


def test_a_failing_listener_is_removed_and_never_reaches_the_step(caplog):
    # GIVEN a failing listener and a working one
    tracker, opt = _tracker(), _Opt()
    seen: list[int] = []

    def fails(step: int) -> None:
        raise RuntimeError("listener bug")

    works = seen.append
    tracker.add_listener(fails)
    tracker.add_listener(works)

    # WHEN the job steps twice
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        tracker._eager_step(opt)
        tracker._eager_step(opt)

    # THEN the steps went on, the working listener saw both, the failing one was dropped with a note
    assert tracker.step == 2 and seen == [1, 2]
    assert tracker._listeners == (works,)
    assert "step listener failed" in caplog.text


def test_a_failure_inside_the_hook_never_reaches_the_training_step(caplog):
    # GIVEN a tracker whose GPU marker breaks
    tracker, opt = _tracker(), _Opt()

    class Broken:
        def mark(self, *args):
            raise RuntimeError("marker bug")

    tracker.gpu = Broken()  # type: ignore[assignment]

    # WHEN the job steps
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        tracker._eager_step(opt)

    # THEN nothing was raised, and the agent's log says what failed
    assert "step hook failed" in caplog.text


def test_the_typical_step_is_the_median_so_one_slow_step_does_not_move_it(monkeypatch):
    # GIVEN steps of 1 s each, then one of 30 s (a trace's start), on a clock the test drives
    clock = [100.0]
    monkeypatch.setattr(_steps, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    tracker, opt = _tracker(), _Opt()
    assert tracker.typical_step_s() == 0.0, "nothing before any step"
    for dt in (1.0, 1.0, 1.0, 1.0, 30.0):
        tracker._eager_step(opt)
        clock[0] += dt
    tracker._eager_step(opt)

    # THEN the typical step is 1 s, while the running mean moved towards the slow one
    assert tracker.typical_step_s() == 1.0
    assert tracker.step_time_s > 1.0


def test_compiled_steps_are_folded_into_the_count_exactly_once(monkeypatch):
    # GIVEN a tracker, and no installed tracker that would fold compiled steps at once
    monkeypatch.setattr(_steps, "_ON_COMPILED_STEP", [None])
    tracker = _tracker()
    before = tracker.all_optimizer_steps()

    # WHEN two optimizer steps ran inside compiled regions (Dynamo replays the hook's store)
    _steps.COMPILED_STEPS.step = True
    _steps.COMPILED_STEPS.step = True

    # THEN the first fold counts both, the second nothing
    assert tracker.all_optimizer_steps() == before + 2
    assert tracker.fold_compiled() is True and tracker.step == 2
    assert tracker.fold_compiled() is False and tracker.step == 2

    # AND a tracker made afterwards does not count another tracker's earlier compiled steps
    assert _tracker().fold_compiled() is False


def test_the_hook_counts_a_real_optimizers_steps_until_uninstalled():
    torch = pytest.importorskip("torch")

    # GIVEN a tracker installed with torch.optim already imported
    tracker = _tracker()
    tracker.install()
    try:
        assert tracker.hook_installed
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        # WHEN the job steps twice
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()

        # THEN two steps, and the optimizer is known (weakly) for the OOM report
        assert tracker.step == 2
        assert any(ref() is opt for ref in tracker.optimizers.values())
    finally:
        tracker.uninstall()

    # WHEN it steps after uninstall THEN nothing is counted
    opt.step()
    assert tracker.step == 2 and not tracker.hook_installed


def test_the_install_callback_runs_once_the_hook_is_in_place_and_its_failure_is_contained(caplog):
    pytest.importorskip("torch")

    # GIVEN a tracker whose install callback fails
    tracker = _tracker()
    calls: list[bool] = []

    def callback() -> None:
        calls.append(tracker.hook_installed)
        raise RuntimeError("callback bug")

    tracker.on_install = callback

    # WHEN it installs
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        tracker.install()
    tracker.uninstall()

    # THEN the callback ran once, after the hook was in place, and its failure is only logged
    assert calls == [True]
    assert "install callback failed" in caplog.text


def test_a_callback_waits_for_its_frame_to_return():
    # GIVEN no profile function on this thread
    assert sys.getprofile() is None
    ran: list[str] = []

    def inner() -> None:
        cancel = _steps._when_returns(sys._getframe(), lambda: ran.append("returned"))
        assert cancel is not None
        ran.append("body")

    # WHEN the frame runs and returns
    inner()

    # THEN the callback ran after its body, once, and the profile slot is free again
    assert ran == ["body", "returned"]
    assert sys.getprofile() is None


def test_a_cancelled_wait_runs_nothing():
    ran: list[str] = []

    def inner() -> None:
        cancel = _steps._when_returns(sys._getframe(), lambda: ran.append("returned"))
        assert cancel is not None
        cancel()

    # WHEN the wait is cancelled before the frame returns
    inner()

    # THEN nothing ran and no profile function is left
    assert ran == [] and sys.getprofile() is None
