"""A call handed to the main (training) thread and waited for from another thread, bounded.

dynprof's own threads never touch what the training thread owns: a read of the job's tensors, a
call into the CUDA caching allocator (which can stop every Python thread while the job's thread
holds the allocator's lock behind a busy GPU). They hand such a call to the main thread, which
runs it at its next bytecode boundary (the agent's pending-call queue,
:func:`dynprof.agent._mainthread.call_soon_in_main_thread`), and wait for it a bounded time. A
main thread inside one long C call runs no bytecode: a call it has not begun by the deadline is
cancelled and never runs late (it would then act on a state the caller no longer waits for); one
it has begun is waited for to its end, so that its result is never lost half-made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.05  # how often the waiter looks at its deadline and at ``give_up``


class NotRun(Exception):
    """The main thread did not run the call: its queue was full, or it had not begun the call
    by the deadline (the call is cancelled). ``str()`` says which, in words."""


def call_on_main(
    call_soon: Callable[[Callable[[], None]], bool],
    fn: Callable[[], T],
    timeout_s: float,
    *,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """``fn()`` run on the main thread through ``call_soon(task) -> queued``, its value returned
    (or its exception raised again here). On the main thread itself, ``fn()`` at once.

    Raises :class:`NotRun` when ``call_soon`` refused it, or when the main thread had not begun
    it within ``timeout_s`` or before ``give_up()`` became true (checked every :data:`POLL_S`);
    the call is then cancelled, never run later."""
    if threading.current_thread() is threading.main_thread():
        return fn()
    lock = threading.Lock()
    done = threading.Event()
    state: dict[str, Any] = {}

    def task() -> None:
        with lock:
            if state.get("cancelled"):
                return
            state["started"] = True
        try:
            state["value"] = fn()
        except BaseException as exc:  # raised again on the waiting thread
            state["error"] = exc
        finally:
            done.set()

    if not call_soon(task):
        raise NotRun("the main thread's queue of pending calls was full")
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if done.wait(min(POLL_S, left) if left > 0 else POLL_S):
            break
        if time.monotonic() < deadline and not give_up():
            continue
        with lock:
            if not state.get("started"):
                state["cancelled"] = True
                if time.monotonic() < deadline:
                    raise NotRun("given up before the main thread began it")
                raise NotRun(f"the training thread ran no Python within {timeout_s:g} s (inside a long call)")
    if "error" in state:
        raise state["error"]
    return state["value"]  # type: ignore[no-any-return]
