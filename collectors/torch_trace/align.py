"""One start step for many processes: the step every one of them still reaches after the
request arrives, so that their traces cover the same steps.

Used by ``dynprof start`` on this node (the processes' own statuses) and over many nodes (each
rank's step and step time, as the nodes' ``ps`` report them). A step time is a measurement only
when it is finite and at least :data:`MIN_STEP_TIME_S`; any other value (0, negative, NaN,
infinite, a denormal such as ``1e-320`` read off the wire) is "unknown", and an unknown pace
puts the start :data:`UNKNOWN_PACE_MARGIN` steps ahead.

    >>> from types import SimpleNamespace as S
    >>> alignment_step([S(step=40, step_time_s=0.1), S(step=41, step_time_s=0.1)], lead_s=1.0)
    52
    >>> alignment_step([S(step=40, step_time_s=1e-323)])
    42
"""

from __future__ import annotations

import math
from typing import Any

ALIGN_LEAD_S = 0.3
"""How far ahead the common step is put, in seconds of training (on one node)."""
ALIGN_RETRIES = 3
"""Attempts at arming, each further ahead when a process found the step already passed."""
MIN_STEP_TIME_S = 1e-6
"""A step shorter than this is not a measurement."""
MAX_MARGIN_STEPS = 10_000
UNKNOWN_PACE_MARGIN = 2
MAX_STEP_NUMBER = 2**63 - 1
"""The largest step number (the wire carries uint64; the CLI takes at most this)."""


def step_time(value: Any) -> float | None:
    """A step time in seconds when ``value`` is one (a finite number of at least
    :data:`MIN_STEP_TIME_S`), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return seconds if math.isfinite(seconds) and seconds >= MIN_STEP_TIME_S else None


def step_time_of_ms(value: Any) -> float | None:
    """A node's ``step_time_ms`` as seconds, or None when it is not a step time."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return step_time(value / 1000.0)
    except OverflowError:  # an int too large for a float
        return None


def margin_steps(lead_s: float, times: list[float]) -> int:
    """Steps that cover ``lead_s`` at the fastest of ``times`` (step times already checked)."""
    if not times:
        return UNKNOWN_PACE_MARGIN
    steps = lead_s / min(times)
    if not math.isfinite(steps) or steps >= MAX_MARGIN_STEPS:
        return MAX_MARGIN_STEPS
    return max(UNKNOWN_PACE_MARGIN, min(MAX_MARGIN_STEPS, math.ceil(steps) + 1))


def alignment_step(statuses: list[Any], lead_s: float = ALIGN_LEAD_S) -> int:
    """A step every process reaches after the request arrives: the furthest one's step,
    plus enough steps to cover ``lead_s`` of training at the fastest process's pace.

    ``statuses`` have ``step`` and ``step_time_s`` (an agent's status, or a rank's row)."""
    current = max(s.step for s in statuses)
    times = [t for t in (step_time(s.step_time_s) for s in statuses) if t is not None]
    return int(min(MAX_STEP_NUMBER, current + margin_steps(lead_s, times)))


def boundary_offsets(statuses: list[Any]) -> list[int] | None:
    """Per process, its step counter minus the first process's, at the same step boundary.

    Ranks of a synchronous job cross each step boundary at nearly the same moment, but an
    attached process counts steps from the attach, so counters of ranks attached at different
    moments disagree. The time of each one's latest boundary says how many boundaries apart
    their counters were read. None when step times (or boundary times) are unknown.
    """
    times = [t for t in (step_time(s.step_time_s) for s in statuses) if t is not None]
    if not times or any(not (math.isfinite(s.last_step_at) and s.last_step_at > 0) for s in statuses):
        return None
    period = sorted(times)[len(times) // 2]
    ref = statuses[0]
    apart = [(s.last_step_at - ref.last_step_at) / period for s in statuses]
    if any(not math.isfinite(a) or abs(a) > MAX_STEP_NUMBER for a in apart):
        return None
    return [int(s.step - round(a) - ref.step) for s, a in zip(statuses, apart)]


def aligned_steps(statuses: list[Any], offsets: list[int], lead_s: float = ALIGN_LEAD_S) -> list[int]:
    """``at_step`` for each process so that all start after the same boundary."""
    common = alignment_step([replace_step(s, s.step - o) for s, o in zip(statuses, offsets)], lead_s)
    return [common + o for o in offsets]


def replace_step(status: Any, step: int) -> Any:
    """A copy of an agent's status (a protobuf message) with another step."""
    copy = type(status)()
    copy.CopyFrom(status)
    copy.step = max(0, step)
    return copy
