"""Run a call with a time limit, in a daemon thread that is abandoned if it overruns.

Used for every passive probe (NVML, smi tools, the kernel log, sysfs counters): a driver call
that hangs must not hang the healthcheck, and a daemon thread does not keep the interpreter
alive at exit. :class:`InFlight` remembers which call each thread is in, so that a call that
did not return is named in the result ("NVML call nvmlDeviceGetPcieReplayCounter did not
return in 10 s").

A thread cannot be stopped, so a probe that can block in a system call that even a killed
process cannot leave (a hard-mounted network filesystem) runs in a child process instead
(:mod:`healthcheck.checks.shared_fs`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# The default time limit of one probe, in seconds.
PROBE_TIMEOUT_S = 10.0


class TimedOut(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"timed out after {seconds:g} s")
        self.seconds = seconds


def did_not_return(what: str, seconds: float) -> str:
    """The reason of a probe that overran its limit: ``WHAT did not return in N s``."""
    return f"{what} did not return in {seconds:g} s"


class InFlight:
    """Which call each thread is in (set by the caller around each call)."""

    def __init__(self) -> None:
        self._calls: dict[int, str] = {}
        self._lock = threading.Lock()

    def enter(self, name: str) -> None:
        with self._lock:
            self._calls[threading.get_ident()] = name

    def leave(self) -> None:
        with self._lock:
            self._calls.pop(threading.get_ident(), None)

    def of(self, thread_id: int | None) -> str | None:
        """The call thread ``thread_id`` is in now, or None."""
        if thread_id is None:
            return None
        with self._lock:
            return self._calls.get(thread_id)


class Call(Generic[T]):
    """``fn()`` started in the background; :meth:`result` waits for it up to a deadline."""

    def __init__(self, fn: Callable[[], T], name: str = "healthcheck-call") -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def result(self, timeout: float) -> T:
        if not self._done.wait(timeout):
            raise TimedOut(timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    return Call(fn).result(timeout)
