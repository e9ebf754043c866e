"""Run a call with a time limit, in a daemon thread that is abandoned if it overruns.

Used for passive reads (NVML, smi tools, the kernel log): a driver call that hangs must not
hang the healthcheck, and a daemon thread does not keep the interpreter alive at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TimedOut(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"timed out after {seconds:g} s")
        self.seconds = seconds


class Call(Generic[T]):
    """``fn()`` started in the background; :meth:`result` waits for it up to a deadline."""

    def __init__(self, fn: Callable[[], T], name: str = "healthcheck-call") -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

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
