"""Interval arithmetic over time: unions of ``[start, end)`` intervals, how much of a window they
cover, their intersection, union, difference and gaps; and the typed arrays that hold the
intervals of one thread or device while a trace is read (about 30 bytes per interval).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterator, Sequence


class Cover:
    """A union of intervals: sorted, disjoint ``[start, end)`` with prefix lengths for O(log n)
    measures of how much of a window it covers."""

    __slots__ = ("cum", "ends", "starts")

    def __init__(self, starts: Sequence[float], ends: Sequence[float]) -> None:
        self.starts = array("d", starts)
        self.ends = array("d", ends)
        cum = array("d", [0.0])
        total = 0.0
        for s, e in zip(starts, ends):
            total += e - s
            cum.append(total)
        self.cum = cum

    @classmethod
    def union(cls, starts: Sequence[float], ends: Sequence[float]) -> Cover:
        """The union of intervals given in any order (empty ones left out)."""
        order = sorted(range(len(starts)), key=starts.__getitem__)
        out_s: list[float] = []
        out_e: list[float] = []
        for i in order:
            s, e = starts[i], ends[i]
            if e <= s:
                continue
            if out_e and s <= out_e[-1]:
                if e > out_e[-1]:
                    out_e[-1] = e
            else:
                out_s.append(s)
                out_e.append(e)
        return cls(out_s, out_e)

    def __len__(self) -> int:
        return len(self.starts)

    def measure(self, a: float, b: float) -> float:
        """Length of this cover inside ``[a, b)``."""
        if b <= a or not self.starts:
            return 0.0
        i = bisect.bisect_right(self.ends, a)
        j = bisect.bisect_left(self.starts, b)
        if i >= j:
            return 0.0
        total = self.cum[j] - self.cum[i]
        if self.starts[i] < a:
            total -= a - self.starts[i]
        if self.ends[j - 1] > b:
            total -= self.ends[j - 1] - b
        return total

    def intersect(self, other: Cover) -> Cover:
        """Where both this cover and ``other`` are."""
        out_s: list[float] = []
        out_e: list[float] = []
        i = j = 0
        while i < len(self.starts) and j < len(other.starts):
            s = max(self.starts[i], other.starts[j])
            e = min(self.ends[i], other.ends[j])
            if s < e:
                out_s.append(s)
                out_e.append(e)
            if self.ends[i] < other.ends[j]:
                i += 1
            else:
                j += 1
        return Cover(out_s, out_e)

    def plus(self, other: Cover) -> Cover:
        """The union of this cover and ``other``."""
        return Cover.union(list(self.starts) + list(other.starts), list(self.ends) + list(other.ends))

    def segments(self, a: float, b: float) -> Iterator[tuple[float, float]]:
        """This cover's intervals that meet ``[a, b)``, each cut to it."""
        i = bisect.bisect_right(self.ends, a)
        while i < len(self.starts) and self.starts[i] < b:
            yield max(self.starts[i], a), min(self.ends[i], b)
            i += 1

    def gaps(self, a: float, b: float) -> Cover:
        """What this cover leaves of ``[a, b)``: the gaps between its intervals there."""
        starts: list[float] = []
        ends: list[float] = []
        cursor = a
        for s, e in self.segments(a, b):
            if s > cursor:
                starts.append(cursor)
                ends.append(s)
            cursor = max(cursor, e)
        if cursor < b:
            starts.append(cursor)
            ends.append(b)
        return Cover(starts, ends)

    def minus(self, other: Cover) -> Cover:
        """This cover less ``other``."""
        if not len(other):
            return self
        common = self.intersect(other)
        out_s: list[float] = []
        out_e: list[float] = []
        for s, e in zip(self.starts, self.ends):
            cursor = s
            for ws, we in common.segments(s, e):
                if ws > cursor:
                    out_s.append(cursor)
                    out_e.append(ws)
                cursor = we
            if cursor < e:
                out_s.append(cursor)
                out_e.append(e)
        return Cover(out_s, out_e)


class Spans:
    """Intervals of one thread or device, kept as typed arrays: start, end, name id, flag."""

    __slots__ = ("ends", "flags", "names", "starts")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")
        self.names = array("l")
        self.flags = array("b")

    def add(self, start: float, end: float, name: int, flag: int) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.names.append(name)
        self.flags.append(flag)

    def __len__(self) -> int:
        return len(self.starts)

    def cover(self, keep: Callable[[int], bool] | None = None) -> Cover:
        if keep is None:
            return Cover.union(self.starts, self.ends)
        idx = [i for i in range(len(self.starts)) if keep(self.flags[i])]
        return Cover.union([self.starts[i] for i in idx], [self.ends[i] for i in idx])


def cover_of(spans: list[Spans], keep: Callable[[int], bool]) -> Cover:
    """The union of the intervals of several :class:`Spans` whose flag ``keep`` takes."""
    starts: list[float] = []
    ends: list[float] = []
    for t in spans:
        for i in range(len(t)):
            if keep(t.flags[i]):
                starts.append(t.starts[i])
                ends.append(t.ends[i])
    return Cover.union(starts, ends)
