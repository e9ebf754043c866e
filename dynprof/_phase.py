"""``dynprof.phase(NAME)``: mark a long phase without optimizer steps (evaluation, checkpoint).

    with dynprof.phase("eval"):
        evaluate(model)

    @dynprof.phase("checkpoint")
    def save(...): ...

The hang watchdog counts an optimizer step as progress; a phase in progress counts as progress
too ("busy, not hung"), and its timeout starts again when the phase ends. ``dynprof ps --json``
and the agent's Status reply name the phase in progress.

It costs two list operations and a clock read per phase, with or without an agent, and never
raises: the job's code runs as if it were not there.
"""

from __future__ import annotations

import time
from contextlib import ContextDecorator
from typing import Any

MAX_NAME = 64

# The phases in progress in this process, innermost last: (name, started_at, token). Changed
# by list.append / list.remove only, which the GIL makes atomic: no lock on the job's threads.
_active: list[tuple[str, float, object]] = []
_last_end = 0.0  # time.time() the latest phase ended


class phase(ContextDecorator):  # used like a function: `with dynprof.phase("eval"):`
    """A phase of the job that makes no optimizer step but is not a hang (see module doc)."""

    def __init__(self, name: str = "busy") -> None:
        try:
            self.name = str(name)[:MAX_NAME] or "busy"
        except Exception:
            self.name = "busy"
        self._tokens: list[tuple[str, float, object]] = []

    def __enter__(self) -> phase:
        try:
            entry = (self.name, time.time(), object())
            self._tokens.append(entry)
            _active.append(entry)
        except Exception:
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        global _last_end
        try:
            entry = self._tokens.pop()
            _last_end = time.time()
            _active.remove(entry)
        except Exception:
            pass


def current() -> tuple[str, float] | None:
    """The innermost phase in progress (name, start time), or None."""
    try:
        name, since, _ = _active[-1]
    except IndexError:
        return None
    return name, since


def busy_until(now: float) -> float:
    """Progress as phases see it: ``now`` while one is in progress, else when the last ended."""
    return now if _active else _last_end
