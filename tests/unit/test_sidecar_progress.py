"""dynprof/sidecar/progress.py, the sidecar's book of its node's ranks: step durations folded
into a histogram between polls, a rank whose agent stops answering keeping its last steps, a
gone process kept a few polls then forgotten, the bound on ranks, a failed read leaving the
book as it was, and a job's stall time. The node's progress is a fake read, polled by hand."""

from __future__ import annotations

import time

from dynprof.sidecar.progress import (
    MIN_STALL_AFTER_S,
    STEP_BUCKETS,
    ProgressBook,
    StepHistogram,
    stall_after_s,
)
from dynprof.watch.model import NodeProgress, RankProgress


class Node:
    """What read_progress answers at the next poll (``rows``), or the error it raises."""

    def __init__(self) -> None:
        self.rows: list[RankProgress] = []
        self.error: Exception | None = None

    def read(self, records, host, job, timeout, every) -> NodeProgress:
        if self.error is not None:
            raise self.error
        return NodeProgress(host=host, time=time.time(), poll_every_s=every, ranks=list(self.rows))


def _row(rank: int | None, pid: int, step: int = 0, at: float = 0.0, **kw) -> RankProgress:
    return RankProgress(job="j", rank=rank, world_size=2, pid=pid, host="n", step=step, last_step_at=at, **kw)


def _book(node: Node, **kw) -> ProgressBook:
    return ProgressBook("n", 2.0, records=lambda: [], read=node.read, **kw)


def test_the_histogram_counts_steps_at_their_mean_duration():
    h = StepHistogram()
    h.observe(4, 2.0)  # 0.5 s each: the bucket of at most 1 s
    h.observe(0, 5.0)
    h.observe(1, -1.0)
    assert h.count == 4 and h.total_s == 2.0
    assert h.counts[STEP_BUCKETS.index(1.0)] == 4
    h.observe(1, 1000.0)
    assert h.counts[-1] == 1  # over every bound
    copy = h.copy()
    copy.observe(1, 0.001)
    assert h.count == 5 and copy.count == 6


def test_steps_between_polls_are_observed():
    node = Node()
    book = _book(node)
    node.rows = [_row(0, 10, step=5, at=100.0)]
    book.poll()
    node.rows = [_row(0, 10, step=9, at=102.0)]
    view = book.poll()
    entry = view.entries[("j", 0)]
    assert entry.row.step == 9 and entry.histogram.count == 4 and entry.histogram.total_s == 2.0
    assert view.polls == 2 and view.host == "n"


def test_an_agent_that_stops_answering_keeps_its_last_steps():
    node = Node()
    book = _book(node)
    node.rows = [_row(0, 10, step=5, at=100.0, step_time_s=0.5)]
    book.poll()
    node.rows = [_row(0, 10, agent="unresponsive")]
    entry = book.poll().entries[("j", 0)]
    assert (entry.row.step, entry.row.last_step_at, entry.row.step_time_s) == (5, 100.0, 0.5)


def test_a_gone_process_is_kept_a_few_polls_then_forgotten():
    node = Node()
    book = _book(node, forget_after=2)
    node.rows = [_row(0, 10, step=3, at=100.0)]
    book.poll()
    node.rows = []
    first = book.poll().entries[("j", 0)]
    assert first.gone and first.row.step == 3 and first.gone_polls == 1
    assert book.poll().entries[("j", 0)].gone_polls == 2
    assert ("j", 0) not in book.poll().entries


def test_a_new_process_in_a_ranks_place_starts_afresh():
    node = Node()
    book = _book(node)
    node.rows = [_row(0, 10, step=50, at=100.0)]
    book.poll()
    node.rows = [_row(0, 11, step=1, at=200.0)]
    entry = book.poll().entries[("j", 0)]
    assert entry.row.pid == 11 and entry.histogram.count == 0


def test_ranks_over_the_bound_and_a_second_process_of_a_rank_are_dropped():
    node = Node()
    book = _book(node, max_ranks=2)
    node.rows = [_row(0, 10), _row(1, 11), _row(2, 12), _row(0, 13)]
    view = book.poll()
    assert sorted(view.entries) == [("j", 0), ("j", 1)] and view.dropped == 2
    assert view.entries[("j", 0)].row.pid == 10


def test_a_failed_read_leaves_the_book_as_it_was():
    node = Node()
    book = _book(node)
    node.rows = [_row(0, 10, step=1, at=1.0)]
    before = book.poll()
    node.error = RuntimeError("the registry is unreadable")
    assert book.poll() is before and book.view() is before


def test_poll_if_stale_reads_only_when_the_book_is_older_than_asked():
    node = Node()
    reads = []
    original = node.read
    node.read = lambda *a: reads.append(1) or original(*a)  # type: ignore[method-assign]
    book = _book(node)
    first = book.poll_if_stale(3600.0)
    assert book.poll_if_stale(3600.0) is first and len(reads) == 1
    book.poll_if_stale(0.0)
    assert len(reads) == 2


def test_a_jobs_stall_time():
    assert stall_after_s([1.0, 2.0], 7.5) == 7.5
    assert stall_after_s([], None) == MIN_STALL_AFTER_S
    assert stall_after_s([0.0, 0.1], None) == MIN_STALL_AFTER_S
    assert stall_after_s([10.0, 4.0, 0.0], None) == 20 * 7.0
