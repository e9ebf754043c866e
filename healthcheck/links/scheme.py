"""Which nodes test their link together in each round, and which node the slow tests name.

Pure: no processes, no network. Nodes are numbered 0..n-1 (the caller keeps the names);
a *group* is a tuple of node numbers that run one link test together (a pair, or a ring of
three when the count is odd). Every node is in at most one group per round, so a round's
tests run at the same time and each node's NIC carries one test.

The search (:class:`LinkSearch`):

- **Round 1** pairs the nodes in order, (0, 1), (2, 3), ...; with an odd count the last node
  joins the last pair as a third (a ring of three: each node sends to the next and receives
  from the previous, so each NIC carries what it carries in a pair).
- A group is **slow** when its figure is more than ``threshold`` below the median of the
  other groups of the same round, or below the SKU baseline's floor where there is one, or
  when its test hung or failed (no figure).
- **Round 2** pairs each member of a slow group with a node of a fast group (a *partner*,
  cleared by round 1); the nodes left over are paired among themselves as controls, so the
  round's median is still that of healthy links. A member whose round-2 pair is slow is
  *named*; one whose pair is fast is *cleared*. A slow group none of whose members was
  tested alone but all others cleared names the remaining one by elimination.
- **Round 3**, only to break ties: a slow group of round 1 whose members were all cleared in
  round 2 is tested again as it was (slow again: the link between those nodes, not one node,
  is slow; fast: it was transient), and members left untested in round 2 (not enough fast
  partners) are paired with cleared nodes.

With one bad node among n >= 4 nodes it is named in <= 2 rounds (tests/unit/test_healthcheck_links_scheme.py
proves it for every position and n = 4..1024). With two bad nodes in different groups both
are named in 2 rounds as long as fast groups outnumber slow ones (else the medians are
slow themselves and only the baseline can judge). Limits of links alone: with **2 nodes**
the one pair is judged against the baseline only and a slow pair cannot name either node
(:attr:`LinkSearch.unresolved` holds both); with **3 nodes** the pairs are tested one at a
time and compared across rounds: (0,1), then (1,2), and (0,2) only on a tie, so a bad
node 1 takes 3 rounds.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

Group = tuple[int, ...]

DEFAULT_THRESHOLD = 0.10  # a group more than 10 % below the median of the others is slow


@dataclass
class RoundOutcome:
    """One round: its groups and their figures (GB/s; None: the test hung or failed)."""

    number: int
    groups: list[Group]
    figures: list[float | None]
    slow: list[bool] = field(default_factory=list)
    references: list[float | None] = field(default_factory=list)  # the median each was judged against


@dataclass
class Named:
    """A node the tests name, with the round and group that isolated it (None: elimination)."""

    node: int
    round: int
    group: Group | None
    by_elimination: bool = False


def median_of_others(figures: Sequence[float | None], index: int) -> float | None:
    others = [f for i, f in enumerate(figures) if i != index and f is not None]
    return statistics.median(others) if others else None


def medians_of_others(figures: Sequence[float | None]) -> list[float | None]:
    """:func:`median_of_others` for every index, in O(n log n): the median of the sorted
    known figures with that one left out."""
    known = sorted(f for f in figures if f is not None)
    out: list[float | None] = []
    for f in figures:
        skip = bisect.bisect_left(known, f) if f is not None else len(known)
        m = len(known) - (1 if f is not None else 0)
        if m <= 0:
            out.append(None)
            continue

        def at(j: int, skip: int = skip) -> float:
            return known[j] if j < skip else known[j + 1]

        out.append(at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2)
    return out


def judge(
    figures: Sequence[float | None],
    threshold: float = DEFAULT_THRESHOLD,
    floor: float | None = None,
    references: Sequence[float | None] | None = None,
) -> tuple[list[bool], list[float | None]]:
    """Which of a round's groups are slow, and the reference each was judged against.

    ``references`` replaces the median of the other groups (the 3-node search compares
    across rounds)."""
    slow: list[bool] = []
    refs: list[float | None] = []
    medians = list(references) if references is not None else medians_of_others(figures)
    for figure, ref in zip(figures, medians, strict=True):
        refs.append(ref)
        if figure is None:
            slow.append(True)
        elif floor is not None and figure < floor:
            slow.append(True)
        else:
            slow.append(ref is not None and figure < (1.0 - threshold) * ref)
    return slow, refs


def first_round(n: int) -> list[Group]:
    """Round 1: pairs in order; an odd last node joins the last pair as a third."""
    if n < 2:
        return []
    if n == 3:
        return [(0, 1)]
    groups: list[Group] = [(i, i + 1) for i in range(0, n - 1, 2)]
    if n % 2:
        groups[-1] = (*groups[-1], n - 1)
    return groups


def pair_up(nodes: Sequence[int]) -> list[Group]:
    """Consecutive pairs of ``nodes``; an odd last one joins the last pair (or sits out alone)."""
    groups: list[Group] = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2 and groups:
        groups[-1] = (*groups[-1], nodes[-1])
    return groups


class LinkSearch:
    """The rounds of a link search over ``n`` nodes: ask :meth:`next_round` for the groups to
    test, :meth:`record` their figures, until :meth:`next_round` answers ``None``; then
    :attr:`named` and :attr:`unresolved` say what the tests found."""

    def __init__(self, n: int, threshold: float = DEFAULT_THRESHOLD, floor: float | None = None) -> None:
        if n < 0:
            raise ValueError("a node count is not negative")
        if not 0.0 < threshold < 1.0:
            raise ValueError("the threshold is a fraction between 0 and 1")
        self.n = n
        self.threshold = threshold
        self.floor = floor
        self.rounds: list[RoundOutcome] = []
        self.named: list[Named] = []
        self.unresolved: list[int] = []  # suspects links alone could not tell apart
        self.slow_links: list[Group] = []  # groups slow twice whose members were each cleared
        self._planned: list[Group] | None = None
        self._done = n < 2
        self._suspect_groups: list[Group] = []
        self._cleared: set[int] = set()
        self._tested_alone: set[int] = set()
        self._retest: list[Group] = []

    # -- the rounds ---------------------------------------------------------------------------
    def next_round(self) -> list[Group] | None:
        if self._done:
            return None
        if self._planned is None:
            self._planned = self._plan()
            if not self._planned:
                self._done = True
                return None
        return list(self._planned)

    def record(self, figures: Sequence[float | None]) -> RoundOutcome:
        groups = self.next_round()
        if groups is None:
            raise ValueError("no round is planned")
        if len(figures) != len(groups):
            raise ValueError(f"{len(groups)} groups, {len(figures)} figures")
        outcome = RoundOutcome(len(self.rounds) + 1, groups, list(figures))
        self._planned = None
        if self.n == 3:
            self._record_three(outcome)
        else:
            outcome.slow, outcome.references = judge(outcome.figures, self.threshold, self.floor)
            self.rounds.append(outcome)
            {1: self._after_first, 2: self._after_second}.get(outcome.number, self._after_third)(outcome)
        return outcome

    def _plan(self) -> list[Group]:
        number = len(self.rounds) + 1
        if self.n == 3:
            three: list[list[Group]] = [[(0, 1)], [(1, 2)], [(0, 2)]]
            return three[number - 1] if number <= 3 else []
        if number == 1:
            return first_round(self.n)
        if number == 2:
            return self._second_round()
        if number == 3:
            return self._third_round()
        return []

    # -- round 1 -> round 2 -------------------------------------------------------------------
    def _after_first(self, outcome: RoundOutcome) -> None:
        self._suspect_groups = [g for g, slow in zip(outcome.groups, outcome.slow, strict=True) if slow]
        self._cleared = {m for g, slow in zip(outcome.groups, outcome.slow, strict=True) if not slow for m in g}
        if not self._suspect_groups:
            self._done = True
        elif self.n == 2:
            self.unresolved = list(self._suspect_groups[0])
            self._done = True
        elif not self._cleared:
            # every group slow (or only one group): nothing is known healthy to pair with
            self.unresolved = sorted({m for g in self._suspect_groups for m in g})
            self._done = True

    def _second_round(self) -> list[Group]:
        suspects = [m for g in self._suspect_groups for m in g]
        first = self.rounds[0]
        partners = [m for g, slow in zip(first.groups, first.slow, strict=True) if not slow for m in g]
        groups: list[Group] = []
        for suspect, partner in zip(suspects, partners, strict=False):
            groups.append((suspect, partner))
            self._tested_alone.add(suspect)
        groups.extend(pair_up(partners[len(groups) :]))  # controls keep the round's median healthy
        return groups

    def _after_second(self, outcome: RoundOutcome) -> None:
        for group, slow in zip(outcome.groups, outcome.slow, strict=True):
            suspect = group[0]
            if suspect not in self._tested_alone:
                continue  # a control pair
            if slow:
                self.named.append(Named(suspect, 2, group))
            else:
                self._cleared.add(suspect)
        self._conclude_groups(outcome.number)

    def _conclude_groups(self, number: int) -> None:
        named = {x.node for x in self.named}
        self._retest = []
        self.unresolved = []
        for group in self._suspect_groups:
            if any(m in named for m in group):
                continue  # explained by a named member
            untested = [m for m in group if m not in self._tested_alone]
            if len(untested) == 1:
                self.named.append(Named(untested[0], number, None, by_elimination=True))
            elif not untested:
                self._retest.append(group)
            else:
                self.unresolved.extend(untested)
        if not self._retest and not self.unresolved:
            self._done = True

    # -- round 3: ties ------------------------------------------------------------------------
    def _third_round(self) -> list[Group]:
        groups: list[Group] = list(self._retest)
        busy = {m for g in groups for m in g}
        free = [c for c in sorted(self._cleared) if c not in busy]
        for suspect, partner in zip(list(self.unresolved), free, strict=False):
            groups.append((suspect, partner))
            busy.update((suspect, partner))
        groups.extend(pair_up([c for c in free if c not in busy]))
        return groups

    def _after_third(self, outcome: RoundOutcome) -> None:
        unresolved = set(self.unresolved)
        for group, slow in zip(outcome.groups, outcome.slow, strict=True):
            if group in self._retest:
                if slow:
                    self.slow_links.append(group)
            elif group[0] in unresolved:
                unresolved.discard(group[0])
                if slow:
                    self.named.append(Named(group[0], 3, group))
        self.unresolved = sorted(unresolved)
        self._done = True

    # -- three nodes: one pair at a time, compared across rounds -------------------------------
    def _record_three(self, outcome: RoundOutcome) -> None:
        self.rounds.append(outcome)
        figs = [r.figures[0] for r in self.rounds]
        if len(figs) == 1:
            outcome.slow, outcome.references = judge(figs, self.threshold, self.floor)
            return
        # every figure so far judged against the others so far
        slow, refs = judge(figs, self.threshold, self.floor)
        for r, s, ref in zip(self.rounds, slow, refs, strict=True):
            r.slow, r.references = [s], [ref]
        self.named = []
        self.unresolved = []
        if len(figs) == 2:
            first, second = slow
            if first and not second:
                self.named = [Named(0, 2, (0, 1))]  # 1 is cleared by (1, 2)
            elif second and not first:
                self.named = [Named(2, 2, (1, 2))]
            else:
                return  # a tie: both slow (node 1, or both links) or both alike: round 3
            self._done = True
            return
        s01, s12, s02 = slow
        if s01 and s12 and not s02:
            self.named = [Named(1, 3, (0, 2), by_elimination=True)]
        elif s01 and s02 and not s12:
            self.named = [Named(0, 3, (0, 2))]
        elif s12 and s02 and not s01:
            self.named = [Named(2, 3, (0, 2))]
        elif s01 or s12 or s02:
            self.unresolved = sorted({m for g, s in zip([(0, 1), (1, 2), (0, 2)], slow, strict=True) if s for m in g})
        self._done = True
