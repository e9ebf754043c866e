"""Waiting on a condition a test cannot be told about, with a far deadline that only a hang
reaches (the deadline is a hang detector, never a measurement)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, what: str = "condition", seen: Callable[[], str] = lambda: "") -> T:
    """``pred()``'s first true value, asked every 0.2 s; past ``timeout`` seconds, an
    AssertionError that says ``what`` and ``seen()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    said = seen()
    raise AssertionError(f"{what} not met before the far deadline" + (f"\n{said}" if said else ""))
