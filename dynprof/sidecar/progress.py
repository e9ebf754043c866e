"""The sidecar's book of its node's ranks: a daemon thread reads every job's progress every few
seconds (:func:`dynprof.watch.progress.read_progress`: every agent asked at once, each with its
own timeout) and keeps what ``GET /api/progress`` and ``GET /metrics`` answer from.

Per rank the book keeps the latest row and what the agent last said of its steps (a rank whose
agent stops answering — stopped, or holding the GIL in C — keeps its last step and the time of
it, so its age goes on growing), and a step-time histogram derived here from Δsteps/Δtime
between two polls: the training thread pays nothing for it (the agent answers a status request
from its own thread with counters it keeps anyway).

Bounded: at most ``max_ranks`` ranks; a rank whose process is gone (no longer among the node's
agents, or its agent gone) stays ``forget_after`` polls (its counters stay readable), then is
forgotten. The HTTP threads never wait for a poll: they read a copy of the book under a lock
held only to swap it.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dynprof.registry import AgentRecord, list_records
from dynprof.watch import stall as stall_rule
from dynprof.watch.model import NodeProgress, RankProgress
from dynprof.watch.progress import read_progress

log = logging.getLogger("dynprof.sidecar")

DEFAULT_EVERY_S = 2.0
MAX_RANKS = 1024  # per node: far above any node's ranks, a bound against a flood of records
FORGET_AFTER_POLLS = 15  # a gone process's row is kept this many polls, then forgotten
# The stall rule is the watch's (dynprof.watch.stall.stall_after_for), written once.
MIN_STALL_AFTER_S = stall_rule.DEFAULT_MIN_STALL_S
STALL_STEP_FACTOR = stall_rule.STALL_STEP_FACTOR
# Step-time histogram buckets (seconds): training steps from 10 ms to minutes, 9 bounds + Inf.
STEP_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 120.0)
READ_TIMEOUT_S = 1.0

Key = tuple[str, int | None]  # (job, rank): one series per rank of a job on this node


@dataclass(slots=True)
class StepHistogram:
    """Step durations observed between polls: ``counts[i]`` steps at most ``STEP_BUCKETS[i]``
    (not cumulative; the last slot is over every bound), their total seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    total_s: float = 0.0

    def observe(self, steps: int, seconds: float) -> None:
        """``steps`` steps took ``seconds`` in all: each counted at their mean duration."""
        if steps <= 0 or seconds < 0:
            return
        mean = seconds / steps
        self.counts[bisect.bisect_left(STEP_BUCKETS, mean)] += steps
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> StepHistogram:
        return StepHistogram(list(self.counts), self.total_s)


@dataclass(slots=True)
class RankEntry:
    """What the book knows of one rank: its latest row (last known steps kept while its agent
    does not answer), its histogram, and how many polls its process has been gone."""

    row: RankProgress
    histogram: StepHistogram = field(default_factory=StepHistogram)
    gone_polls: int = 0

    @property
    def gone(self) -> bool:
        return self.row.agent == "gone"


@dataclass(slots=True)
class BookView:
    """A copy of the book at one poll, for a reader (never changed after it is made)."""

    host: str
    polled_at: float  # time.time() of the poll; 0: never polled
    polled_mono: float  # time.monotonic() of it
    every_s: float
    entries: dict[Key, RankEntry] = field(default_factory=dict)
    dropped: int = 0  # ranks not kept: over max_ranks, or a second process claiming a kept rank's place
    polls: int = 0


def stall_after_s(step_times: list[float], given: float | None) -> float:
    """The stall time of a job: ``given`` (``serve --stall-after``) when set, else the watch's
    rule (:func:`dynprof.watch.stall.stall_after_for`: the larger of 60 s and 20 times the
    median step time of the job's ranks whose step time is known)."""
    return stall_rule.stall_after_for(step_times, given)


class ProgressBook:
    """The book, and its poller thread (:meth:`start`). ``records`` lists the node's agents,
    ``read`` reads their progress (both replaceable in tests)."""

    def __init__(
        self,
        host: str,
        every_s: float = DEFAULT_EVERY_S,
        *,
        records: Callable[[], list[AgentRecord]] | None = None,
        read: Callable[..., NodeProgress] = read_progress,
        max_ranks: int = MAX_RANKS,
        forget_after: int = FORGET_AFTER_POLLS,
        stall_after: float | None = None,
        timeout: float = READ_TIMEOUT_S,
    ) -> None:
        if records is None:
            records = list_records
        self.host = host
        self.every_s = every_s
        self.stall_after = stall_after
        self.on_demand_max_age_s = 1.0  # without a poller, /metrics reads at most this often
        self._records = records
        self._read = read
        self._max_ranks = max_ranks
        self._forget_after = forget_after
        self._timeout = timeout
        self._lock = threading.Lock()  # held only to swap the view
        self._poll_lock = threading.Lock()  # one poll at a time
        self._view = BookView(host, 0.0, 0.0, every_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading ---------------------------------------------------------------------------
    def view(self) -> BookView:
        with self._lock:
            return self._view

    def fresh(self, view: BookView | None = None) -> bool:
        """Whether the book was polled within two intervals (a running poller's book; a poll
        may take the read's timeout on top of its interval)."""
        view = view or self.view()
        age = time.monotonic() - view.polled_mono
        return self.every_s > 0 and view.polls > 0 and age <= 2 * self.every_s + self._timeout

    def progress(self, job: str | None = None, view: BookView | None = None) -> NodeProgress:
        """The progress document of ``job`` (every job when None) from the book: each rank's
        latest row, its last known steps, its age now."""
        view = view or self.view()
        now = time.time()
        rows = []
        for (row_job, _), entry in view.entries.items():
            if job is not None and row_job != job:
                continue
            row = replace(entry.row)
            if row.last_step_at > 0:
                row.last_step_age_s = max(0.0, now - row.last_step_at)
            rows.append(row)
        rows.sort(key=lambda r: (r.job, r.rank if r.rank is not None else 1 << 40, r.pid))
        return NodeProgress(host=view.host, time=now, poll_every_s=self.every_s, ranks=rows, truncated=view.dropped)

    def stall_after_of(self, job: str, view: BookView | None = None) -> float:
        view = view or self.view()
        times = [e.row.step_time_s for (j, _), e in view.entries.items() if j == job and not e.gone]
        return stall_after_s(times, self.stall_after)

    # -- polling ---------------------------------------------------------------------------
    def poll(self) -> BookView:
        """One read of every job's ranks on the node, folded into the book. Never raises: a
        failed read is logged and leaves the book as it was."""
        with self._poll_lock:
            return self._poll_locked()

    def poll_if_stale(self, max_age_s: float) -> BookView:
        """The book, polled first when it is older than ``max_age_s`` (no poller running;
        scrapes at the same time share one poll)."""
        view = self.view()
        if view.polls and time.monotonic() - view.polled_mono <= max_age_s:
            return view
        with self._poll_lock:
            view = self.view()
            if view.polls and time.monotonic() - view.polled_mono <= max_age_s:
                return view
            return self._poll_locked()

    def _poll_locked(self) -> BookView:
        try:
            node = self._read(self._records(), self.host, None, self._timeout, self.every_s)
            view = self._fold(self.view(), node)
        except Exception as exc:  # the poller must outlive any one read
            log.error("dynprof serve: reading the node's progress failed: %s: %s", type(exc).__name__, exc)
            return self.view()
        with self._lock:
            self._view = view
        return view

    def _fold(self, old: BookView, node: NodeProgress) -> BookView:
        entries: dict[Key, RankEntry] = {}
        dropped = 0
        seen: set[Key] = set()
        for row in node.ranks:
            key = (row.job, row.rank)
            before = old.entries.get(key)
            if key in seen:  # a second process of the same job and rank (ranks without a rank)
                if before is not None and before.row.pid == row.pid:
                    entries[key] = self._advance(before, row)  # keep the one already in the book
                dropped += 1
                continue
            if before is None and len(entries) >= self._max_ranks:
                dropped += 1
                continue
            seen.add(key)
            entries[key] = self._advance(before, row)
        pids = {e.row.pid for e in entries.values()}
        for key, before in old.entries.items():
            # a process seen under another key (it learned its rank) moved: nothing is gone
            if key in seen or before.row.pid in pids or len(entries) >= self._max_ranks:
                continue
            gone = before.gone_polls + 1
            if gone > self._forget_after:
                continue
            row = replace(before.row, agent="gone", process_state="gone", polled_at=node.time)
            entries[key] = RankEntry(row, before.histogram, gone)
        return BookView(
            host=old.host,
            polled_at=node.time,
            polled_mono=time.monotonic(),
            every_s=self.every_s,
            entries=entries,
            dropped=dropped + node.truncated,
            polls=old.polls + 1,
        )

    @staticmethod
    def _advance(before: RankEntry | None, row: RankProgress) -> RankEntry:
        """The entry of ``row`` given what the book had: a new process starts afresh; an agent
        that did not answer keeps its last known steps; steps taken since the last poll are
        observed in the histogram at their mean duration."""
        if before is None or before.row.pid != row.pid:
            return RankEntry(row, StepHistogram(), 1 if row.agent == "gone" else 0)
        histogram = before.histogram.copy()
        last = before.row
        if row.agent != "up":
            row = replace(
                row,
                step=last.step,
                last_step_at=last.last_step_at,
                step_time_s=last.step_time_s,
                rank=row.rank if row.rank is not None else last.rank,
                world_size=row.world_size if row.world_size is not None else last.world_size,
            )
        elif row.step > last.step and 0 < last.last_step_at <= row.last_step_at:
            histogram.observe(row.step - last.step, row.last_step_at - last.last_step_at)
        return RankEntry(row, histogram, before.gone_polls + 1 if row.agent == "gone" else 0)

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        """Poll every ``every_s`` seconds on a daemon thread (interval counted from the start
        of one poll to the next; a poll that takes longer is followed by the next at once)."""
        if self.every_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dynprof-progress", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began)))
