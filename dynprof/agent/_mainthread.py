"""Run a function on the main thread at its next bytecode boundary.

Uses CPython's pending-call queue (``Py_AddPendingCall``), the same mechanism that runs
signal handlers, without sending a signal. The function runs in the main thread with the GIL
held, typically within milliseconds; a main thread stuck in a long C call runs it when the
call returns. Used for captures that must run on the training thread when there are no
optimizer steps to align to (torch.profiler records the operators of the thread that starts it).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("dynprof.agent")

_PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_lock = threading.Lock()
_queue: list[Callable[[], None]] = []


def _drain(_: int | None) -> int:
    # Must return 0: a non-zero return with an exception set would raise in the main thread.
    with _lock:
        work = list(_queue)
        _queue.clear()
    for fn in work:
        try:
            fn()
        except BaseException:
            log.exception("main-thread task failed")
    return 0


_callback = _PENDING(_drain)
_add_pending = ctypes.pythonapi.Py_AddPendingCall
_add_pending.argtypes = [_PENDING, ctypes.c_void_p]
_add_pending.restype = ctypes.c_int


def call_soon_in_main_thread(fn: Callable[[], None]) -> bool:
    """Queue ``fn`` to run on the main thread. Returns False if CPython's queue was full."""
    with _lock:
        _queue.append(fn)
    if _add_pending(_callback, None) != 0:
        with _lock:
            if fn in _queue:
                _queue.remove(fn)
        return False
    return True
