"""The watch's stall rule: has a job made no step for far longer than its steps take.

Pure: the progress rows (:class:`~dynprof.watch.model.RankProgress`) in, a :class:`Stall` out.
The watch (:mod:`dynprof.watch.engine`) and the sidecar (:mod:`dynprof.sidecar.progress`: its
metrics, its page) use this one rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dynprof.watch.model import RankProgress

DEFAULT_MIN_STALL_S = 60.0  # the least stall time (see "stall" below)
STALL_STEP_FACTOR = 20.0  # the stall time, in the job's median step times


# -- stall -------------------------------------------------------------------------------------------
# A job stalls when no rank has made a step for far longer than its steps take: the measure is the
# job's own rhythm, ``STALL_STEP_FACTOR`` times its median step time (a step 20 times the median is
# no slow step, while the pauses a healthy job makes between steps, a log flush, a short
# evaluation, a checkpoint, last a few steps' time), never under ``DEFAULT_MIN_STALL_S`` (a job of
# fast steps pauses for seconds too: a garbage collection, a DataLoader's refill, a first
# compilation). The evidence is each rank's mean step time, as its agent measures it; with none
# known, the floor. The watch and the sidecar (its metrics, its page) use this one rule.
def median_step_time(rows: Sequence[RankProgress]) -> float:
    """The job's median step time over ranks that know theirs; 0 when none does."""
    times = [r.step_time_s for r in rows if r.step_time_s > 0]
    return float(statistics.median(times)) if times else 0.0


def stall_after_for(step_times: Sequence[float], given: float | None = None) -> float:
    """The stall time of a job whose ranks' step times are ``step_times`` (0: not known):
    ``given`` (``--stall-after``) when set, else the larger of ``DEFAULT_MIN_STALL_S`` and
    ``STALL_STEP_FACTOR`` times their median (see above)."""
    if given is not None:
        return given
    known = [t for t in step_times if t > 0]
    median = float(statistics.median(known)) if known else 0.0
    return max(DEFAULT_MIN_STALL_S, STALL_STEP_FACTOR * median)


def default_stall_after(rows: Sequence[RankProgress]) -> float:
    """The stall time of the job of ``rows`` (see :func:`stall_after_for`)."""
    return stall_after_for([r.step_time_s for r in rows])


def rank_age(row: RankProgress) -> float | None:
    """Seconds since the rank last stepped; before its first step, since its process started
    (both on the node's clock); None when neither is known."""
    if row.step > 0 and row.last_step_age_s is not None:
        return row.last_step_age_s
    if row.started_at and row.polled_at and row.polled_at >= row.started_at:
        return row.polled_at - row.started_at
    return None


EXITED_STATES = ("gone", "zombie", "dead")  # a process state whose rank has exited


@dataclass(slots=True)
class Stall:
    stalled: bool
    age_s: float | None  # the job's age: the smallest rank age (None: no rank to judge)
    stall_after_s: float
    first_step: bool  # no rank has stepped yet: the age counts from the processes' start
    last_step: int  # the highest step of any rank
    ranks: int


def check_stall(rows: Sequence[RankProgress], stall_after: float | None = None) -> Stall:
    """Whether no rank of ``rows`` (one job, every node) advanced for the stall time."""
    live = [r for r in rows if r.process_state not in EXITED_STATES]
    limit = stall_after if stall_after is not None else default_stall_after(live)
    ages = [a for a in (rank_age(r) for r in live) if a is not None]
    age = min(ages) if ages else None
    return Stall(
        stalled=age is not None and age >= limit,
        age_s=age,
        stall_after_s=limit,
        first_step=bool(live) and all(r.step == 0 for r in live),
        last_step=max((r.step for r in live), default=0),
        ranks=len(live),
    )
