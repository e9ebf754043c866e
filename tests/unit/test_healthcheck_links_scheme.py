"""healthcheck.links.scheme: the pairing rounds name one bad node in <= 2 rounds."""

from __future__ import annotations

import random

import pytest

from healthcheck.links.scheme import LinkSearch, first_round, judge, median_of_others, pair_up


def simulate(
    n: int, speeds: dict[int, float], noise: float = 0.0, seed: int = 0, floor: float | None = None
) -> LinkSearch:
    """Run a search where a group's figure is its slowest member's speed (1.0 healthy), with
    a relative noise of up to ``noise``; None for a speed of 0 (a hung test)."""
    rng = random.Random(seed)
    search = LinkSearch(n, floor=floor)
    while (groups := search.next_round()) is not None:
        # every node is in at most one group of a round
        members = [m for g in groups for m in g]
        assert len(members) == len(set(members))
        figures: list[float | None] = []
        for g in groups:
            speed = min(speeds.get(m, 1.0) for m in g)
            figures.append(None if speed == 0 else speed * (1 + rng.uniform(-noise, noise)))
        search.record(figures)
        assert len(search.rounds) <= 3
    return search


@pytest.mark.parametrize("n", [*range(4, 130), 255, 256, 257, 511, 512, 513, 1023, 1024])
def test_one_bad_node_is_named_within_two_rounds_wherever_it_sits(n):
    for bad in range(n):
        # GIVEN one node whose links are half as fast (or hung: no figure)
        for speed in (0.5, 0.0) if n <= 130 else (0.5,):
            # WHEN the rounds run
            search = simulate(n, {bad: speed}, noise=0.03, seed=bad)
            # THEN exactly that node is named, in round 2 at the latest
            assert [x.node for x in search.named] == [bad], (n, bad, speed)
            assert search.named[0].round <= 2
            assert len(search.rounds) <= 2
            assert search.unresolved == [] and search.slow_links == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 64, 1023, 1024])
def test_healthy_nodes_are_never_named_and_take_one_round(n):
    for seed in range(20):
        # GIVEN healthy nodes with a few % of noise
        search = simulate(n, {}, noise=0.04, seed=seed)
        # THEN nothing is named; one round suffices (three nodes test one pair a round)
        assert search.named == [] and search.unresolved == [] and search.slow_links == []
        assert len(search.rounds) == (3 if n == 3 else 1)


def test_two_nodes_cannot_be_told_apart_by_links_alone():
    # GIVEN two nodes, one slow, judged against a baseline floor (no other pair to compare)
    search = simulate(2, {1: 0.5}, floor=0.8)
    # THEN the pair is slow but neither node is named: both are unresolved
    assert search.named == [] and search.unresolved == [0, 1]
    # and without a baseline a slow pair is not even seen
    assert simulate(2, {1: 0.5}).unresolved == []
    # a hung pair is seen either way
    assert simulate(2, {0: 0.0}).unresolved == [0, 1]


def test_three_nodes_take_three_rounds_when_the_middle_one_is_bad():
    for bad, rounds in ((0, 2), (2, 2), (1, 3)):
        search = simulate(3, {bad: 0.5}, noise=0.02)
        assert [x.node for x in search.named] == [bad]
        assert len(search.rounds) == rounds


@pytest.mark.parametrize("n", [8, 9, 16, 33, 64, 200])
def test_two_bad_nodes_are_both_named_within_two_rounds(n):
    for a in range(n):
        for b in range(a + 1, n, max(1, n // 11)):
            search = simulate(n, {a: 0.5, b: 0.5}, noise=0.03, seed=a * n + b)
            assert sorted(x.node for x in search.named) == [a, b], (n, a, b)
            assert len(search.rounds) <= 2


def test_two_bad_nodes_among_four_in_one_pair_need_the_baseline():
    # GIVEN four nodes where 0 and 1 (one pair) are both slow: every test has a slow member
    # except (2, 3); round 2 pairs each with a healthy node and both are slow alike
    without = simulate(4, {0: 0.5, 1: 0.5})
    with_floor = simulate(4, {0: 0.5, 1: 0.5}, floor=0.8)
    # THEN the medians alone cannot name them; the baseline does
    assert without.named == []
    assert sorted(x.node for x in with_floor.named) == [0, 1]


def test_a_slow_link_between_two_healthy_nodes_is_a_slow_link_not_a_node():
    # GIVEN a search where the link (4, 5) alone is slow, whatever the nodes
    search = LinkSearch(10)
    slow_pair = (4, 5)
    while (groups := search.next_round()) is not None:
        search.record([0.4 if g == slow_pair else 1.0 for g in groups])
    # THEN round 3 retests it and names the link, not a node
    assert search.named == [] and search.slow_links == [slow_pair]
    assert len(search.rounds) == 3


def test_round_one_shapes():
    assert first_round(1) == []
    assert first_round(2) == [(0, 1)]
    assert first_round(5) == [(0, 1), (2, 3, 4)]
    assert first_round(6) == [(0, 1), (2, 3), (4, 5)]
    for n in range(2, 300):
        members = sorted(m for g in first_round(n) for m in g)
        assert members == (list(range(n)) if n != 3 else [0, 1])


def test_judge_uses_the_median_of_the_others_and_the_floor():
    slow, refs = judge([10.0, 10.2, 8.0, None], threshold=0.1)
    assert slow == [False, False, True, True]
    assert refs[2] == 10.1
    assert judge([10.0, 10.0], floor=11.0)[0] == [True, True]


def test_medians_of_others_match_the_plain_median():
    from healthcheck.links.scheme import median_of_others, medians_of_others

    rng = random.Random(1)
    for size in range(0, 40):
        figures = [None if rng.random() < 0.2 else round(rng.uniform(0, 5), 1) for _ in range(size)]
        assert medians_of_others(figures) == [median_of_others(figures, i) for i in range(size)]


@pytest.mark.parametrize(
    ("nodes", "groups"),
    [
        ([4, 7, 9, 2], [(4, 7), (9, 2)]),
        ([4, 7, 9], [(4, 7, 9)]),
        ([5], []),
        ([], []),
    ],
)
def test_pair_up_pairs_in_order_and_an_odd_last_node_joins_the_last_pair(nodes, groups):
    # GIVEN the nodes left to test, in the order given
    # THEN consecutive pairs; a lone node cannot be tested with nobody
    assert pair_up(nodes) == groups


def test_the_median_of_the_others_leaves_out_the_node_itself_and_missing_figures():
    figures = [10.0, None, 30.0, 100.0]
    assert median_of_others(figures, 0) == 65.0  # 30 and 100
    assert median_of_others(figures, 1) == 30.0  # 10, 30 and 100
    assert median_of_others([5.0, None], 0) is None, "nobody else measured"


def test_a_missing_figure_is_slow_whatever_the_others():
    slow, refs = judge([None, 50.0, 50.0])
    assert slow == [True, False, False]
    assert refs[0] == 50.0


def test_references_given_replace_the_median_of_the_others():
    slow, refs = judge([50.0, 50.0], threshold=0.1, references=[100.0, 50.0])
    assert slow == [True, False] and refs == [100.0, 50.0]
