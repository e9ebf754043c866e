"""Step boundaries of optimizers stepped on autograd's device threads reach the training thread."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from dynprof.agent import _steps
from dynprof.agent._steps import StepTracker


class _Optimizer:
    pass


# Stands for loss.backward() on the main thread: a function of torch's backward entry file whose
# C++ call waits while autograd's device thread runs the hooks, and that returns (the main
# thread runs Python again) once that thread is done.
_namespace: dict[str, object] = {}
exec(compile("def backward_wait(done):\n    done.wait(30)\n", "/site-packages/torch/_tensor.py", "exec"), _namespace)
_backward_wait = _namespace["backward_wait"]


def test_a_boundary_from_an_autograd_device_thread_is_delivered_on_the_main_thread(monkeypatch):
    # GIVEN a tracker with a listener, a "backward" that the main thread waits in, and an optimizer
    # stepped on another thread that autograd runs for it (a graph task, no backward frame of its own)
    in_graph_task = threading.local()
    monkeypatch.setattr(_steps, "_in_backward", lambda: getattr(in_graph_task, "on", False))
    tracker = StepTracker()
    seen: list[tuple[int, bool]] = []
    tracker.add_listener(lambda step: seen.append((step, threading.current_thread() is threading.main_thread())))
    done = threading.Event()
    opt = _Optimizer()

    main_ident = threading.main_thread().ident

    def main_waits_in_backward() -> bool:
        frame = sys._current_frames().get(main_ident or -1)
        while frame is not None:
            if frame.f_code is _backward_wait.__code__:  # type: ignore[attr-defined]
                return True
            frame = frame.f_back
        return False

    def device_thread() -> None:
        in_graph_task.on = True
        # The optimizer steps only once the main thread waits in its "backward" (on a loaded
        # machine the main thread may not have got there for a long while after start())
        deadline = time.monotonic() + 60
        while not main_waits_in_backward() and time.monotonic() < deadline:
            time.sleep(0.005)
        tracker._eager_step(opt)
        done.set()

    worker = threading.Thread(target=device_thread)
    worker.start()

    # WHEN the main thread's backward returns and it runs Python again
    _backward_wait(done)
    worker.join(30)
    for _ in range(100):  # the pending call runs at the next bytecodes of the main thread
        if seen:
            break
        time.sleep(0.01)

    # THEN the step was counted and its boundary ran on the main thread, which is the thread
    # dynprof's profiler follows, not autograd's
    assert tracker.step == 1
    assert seen == [(1, True)]
    assert tracker.hook_thread_id == threading.main_thread().ident


def test_a_boundary_on_a_thread_that_runs_its_own_backward_stays_there(monkeypatch):
    # GIVEN an optimizer stepped on a thread outside any backward (a training loop in a thread)
    tracker = StepTracker()
    seen: list[bool] = []
    tracker.add_listener(lambda step: seen.append(threading.current_thread() is threading.main_thread()))

    # WHEN it steps
    worker = threading.Thread(target=tracker._eager_step, args=(_Optimizer(),))
    worker.start()
    worker.join(30)

    # THEN its boundary ran right there, on that thread
    assert seen == [False]


if __name__ == "__main__":
    pytest.main([__file__])
