"""Interval arithmetic (collectors/trace_analysis/intervals.py): unions of ``[start, end)``
intervals, what they cover of a window, and the covers made from them."""

from __future__ import annotations

import pytest

from collectors.trace_analysis.intervals import Cover, Spans, cover_of


def pairs(cover: Cover) -> list[tuple[float, float]]:
    return list(zip(cover.starts, cover.ends))


def test_union_sorts_merges_overlapping_and_touching_intervals_and_drops_empty_ones():
    # GIVEN intervals out of order: two overlapping, one touching the next, one empty, one reversed
    cover = Cover.union([5, 0, 2, 8, 9, 7], [6, 3, 4, 9, 9, 6])
    # THEN the union is sorted and disjoint
    assert pairs(cover) == [(0, 4), (5, 6), (8, 9)]
    assert len(cover) == 3
    assert pairs(Cover.union([], [])) == [] and len(Cover.union([], [])) == 0


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (0, 10, 7),  # all of it
        (1, 3, 2),  # inside the first interval
        (4, 5, 0),  # in a hole
        (3, 5.5, 1.5),  # the end of one, a hole, the start of the next
        (2, 8.5, 3.5),  # 2-4, 5-6, 8-8.5
        (10, 20, 0),  # after it
        (5, 5, 0),  # an empty window
        (6, 2, 0),  # a reversed one
    ],
)
def test_measure_is_how_much_of_a_window_the_cover_holds(a, b, expected):
    cover = Cover.union([0, 5, 8], [4, 6, 10])
    assert cover.measure(a, b) == pytest.approx(expected)


def test_intersect_and_plus():
    x = Cover.union([0, 10], [5, 15])
    y = Cover.union([3, 12, 20], [11, 13, 30])
    assert pairs(x.intersect(y)) == [(3, 5), (10, 11), (12, 13)]
    assert pairs(x.plus(y)) == [(0, 15), (20, 30)]
    assert pairs(x.intersect(Cover([], []))) == []


def test_segments_are_the_intervals_meeting_a_window_cut_to_it():
    cover = Cover.union([0, 5, 8], [4, 6, 10])
    assert list(cover.segments(2, 9)) == [(2, 4), (5, 6), (8, 9)]
    assert list(cover.segments(4, 5)) == []
    assert list(cover.segments(6, 7)) == []


def test_gaps_are_what_the_cover_leaves_of_a_window():
    cover = Cover.union([0, 5, 8], [4, 6, 10])
    assert pairs(cover.gaps(-2, 12)) == [(-2, 0), (4, 5), (6, 8), (10, 12)]
    assert pairs(cover.gaps(1, 3)) == []  # all covered
    assert pairs(cover.gaps(4, 5)) == [(4, 5)]  # all a gap
    assert pairs(Cover([], []).gaps(1, 2)) == [(1, 2)]


def test_minus_takes_away_what_the_other_cover_holds():
    x = Cover.union([0, 10], [5, 15])
    y = Cover.union([1, 4, 12], [2, 11, 20])
    assert pairs(x.minus(y)) == [(0, 1), (2, 4), (11, 12)]
    assert pairs(x.minus(Cover([], []))) == pairs(x)
    assert pairs(x.minus(x)) == []
    # what is left and what was taken add up to the whole
    assert x.minus(y).measure(0, 20) + x.intersect(y).measure(0, 20) == pytest.approx(x.measure(0, 20))


def test_spans_keep_their_intervals_and_cover_those_a_flag_selects():
    # GIVEN one thread's spans: two of flag 0 (overlapping), one of flag 1
    spans = Spans()
    spans.add(0.0, 4.0, 10, 0)
    spans.add(2.0, 6.0, 11, 0)
    spans.add(8.0, 9.0, 12, 1)
    assert len(spans) == 3
    assert list(spans.names) == [10, 11, 12] and list(spans.flags) == [0, 0, 1]

    # THEN its cover is their union, of all or of those whose flag is kept
    assert pairs(spans.cover()) == [(0, 6), (8, 9)]
    assert pairs(spans.cover(lambda f: f == 1)) == [(8, 9)]
    assert pairs(spans.cover(lambda f: f == 2)) == []


def test_cover_of_several_threads_is_the_union_of_their_kept_spans():
    a, b = Spans(), Spans()
    a.add(0.0, 3.0, 0, 0)
    a.add(10.0, 11.0, 0, 2)
    b.add(2.0, 5.0, 0, 0)
    b.add(7.0, 8.0, 0, 1)
    assert pairs(cover_of([a, b], lambda f: f != 2)) == [(0, 5), (7, 8)]
    assert pairs(cover_of([], lambda f: True)) == []
