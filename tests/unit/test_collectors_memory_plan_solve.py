"""The memory plan's search (collectors.memory.plan.solve): the cheapest sets against brute force
over every subset, its bound on crafted measurements (merged states, a proven slack), and
runners-up that are not equal blocks in another order."""

from __future__ import annotations

import itertools
import random

import pytest

import collectors.memory.plan.solve as plan_solve
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.predict import Candidates, peak_with, predict
from collectors.memory.plan.render import render_artifact
from collectors.memory.plan.solve import make_plan, solve
from tests.support.scripts import load_script
from tests.unit._plan_models import brute_force, chain


def random_chain(rng: random.Random, n: int, scale: int = 1000) -> Candidates:
    """A random measurement-like problem of ``n`` blocks in a chain (forward in order, backward
    in reverse), bytes in thousands so that the search has many states to keep; about one
    problem in four repeats its first block's sizes and time (equal layers)."""
    fe = [2 + 2 * j for j in range(n)]
    mid = 2 * n + 1
    bs = [mid + 1 + (n - 1 - j) for j in range(n)]
    segments = mid + n + 2
    timeline = [(rng.randint(50, 400) * scale, rng.choice([0, rng.randint(50, 400) * scale])) for _ in range(segments)]
    freeable = [rng.randint(0, 60 * scale) for _ in range(n)]
    casts = [rng.randint(0, f) for f in freeable]
    seconds = [round(rng.uniform(0.01, 3.0), 3) for _ in range(n)]
    if rng.random() < 0.25:
        freeable, casts, seconds = [freeable[0]] * n, [casts[0]] * n, [seconds[0]] * n
    return Candidates(
        index=list(range(n)),
        freeable=freeable,
        casts=casts,
        seconds=seconds,
        forward_end=fe,
        backward_start=bs,
        recompute_peak=[rng.randint(100, 450) * scale for _ in range(n)],
        late=[[] for _ in range(n)],
        timeline=timeline,
        untracked=rng.choice([0, 5]),
        static=rng.randint(0, 60) * scale,
        kept=[[] for _ in range(n)],
    )


def every_set(c: Candidates, target: int) -> list[tuple[float, int, tuple[int, ...]]]:
    """(cost, predicted peak, set) of every subset whose predicted peak is at most ``target``,
    cheapest first: brute force, by peak_with itself."""
    n = len(c.freeable)
    out = []
    for r in range(n + 1):
        for subset in itertools.combinations(range(n), r):
            peak = peak_with(c, subset)
            if peak <= target:
                out.append((round(sum(c.seconds[i] for i in subset), 9), peak, subset))
    return sorted(out)


def a_target(rng: random.Random, c: Candidates) -> int:
    every, none = peak_with(c, range(len(c.freeable))), peak_with(c, [])
    return rng.randint(min(every, none) - 10, max(every, none))


def test_the_cheapest_set_is_brute_forces_on_200_random_plans_of_1_to_12_blocks():
    # GIVEN 200 random chains of 1 to 12 blocks (a quarter of them of equal blocks) and a target
    rng = random.Random(48)
    compared = 0
    for _ in range(200):
        c = random_chain(rng, rng.randint(1, 12))
        target = a_target(rng, c)
        # WHEN the search solves it
        got, exact = solve(c, target)
        want = every_set(c, target)
        # THEN it is exact (a chain, far under the bound), and its cheapest set costs what the
        # cheapest of all subsets costs, or there is none
        assert exact
        if not want:
            assert got == []
            continue
        compared += 1
        assert round(got[0].cost, 9) == want[0][0]
        # AND every answer is a set brute force found, meeting the target by peak_with, cheapest
        # first, no two of equal cost and peak freeing the same bytes (equal blocks reordered)
        found = {subset for _, _, subset in want}
        for ch in got:
            assert ch.blocks in found and ch.peak == peak_with(c, ch.blocks) <= target
        assert [ch.cost for ch in got] == sorted(ch.cost for ch in got)
        assert len({(round(ch.cost, 9), ch.peak, ch.freed) for ch in got}) == len(got)
    assert compared > 100


def test_a_search_cut_at_its_bound_is_no_dearer_than_the_cheapest_for_the_budget_less_its_slack(monkeypatch):
    # GIVEN random chains, and a search allowed 3 states per block (it must merge)
    monkeypatch.setattr(plan_solve, "MIN_KEYS", 3)
    rng = random.Random(5)
    merged = compared = 0
    for _ in range(300):
        c = random_chain(rng, rng.randint(6, 10))
        target = a_target(rng, c)
        # WHEN it solves with the least work
        info: dict[str, int] = {}
        got, exact = solve(c, target, keep=1, work=1, info=info)
        if exact:
            continue
        merged += 1
        # THEN what it answers meets the target, and is no dearer than the cheapest set that
        # meets the target less the bytes its merges may have given away
        for ch in got:
            assert ch.peak == peak_with(c, ch.blocks) <= target
        tighter = every_set(c, target - info["slack_bytes"])
        if tighter:
            compared += 1
            assert got and round(got[0].cost, 9) <= tighter[0][0]
    assert merged > 30 and compared > 10


def test_runners_up_of_equal_blocks_are_other_counts_not_other_orders():
    # GIVEN 16 equal blocks (the bench's deep stack of equal layers), half of them to free
    bench = load_script("bench_plan_solver")
    doc = bench.craft(16, alike=True)
    m = from_json(doc["measurement"])
    # WHEN planned
    got = make_plan(m, budget=doc["asked"]["budget_bytes"])
    # THEN the plan is exact, and each runner-up checkpoints more blocks than the one before
    # (the same number of equal blocks in another order is not an alternative)
    assert got["status"] == "fits" and got["exact"]
    counts = [len(p["modules"]) for p in [got["plan"], *got["runners_up"]]]
    assert counts == list(range(counts[0], counts[0] + 4))


def test_a_crafted_plan_of_4096_blocks_is_answered_within_the_bound_and_says_it_is_not_exact(monkeypatch):
    # GIVEN the bench's adversarial plan.json of 4 096 blocks (no set of its blocks beats
    # another, every segment and entry the decoder allows), as a stored artifact
    bench = load_script("bench_plan_solver")
    doc = bench.craft(4096)
    checked = []
    real = plan_solve.peak_with

    def counting(c, chosen, where=None):
        checked.append(len(chosen))
        return real(c, chosen, where)

    monkeypatch.setattr(plan_solve, "peak_with", counting)
    # WHEN `dynprof show` renders it
    summary, text = render_artifact(bench._Stored(doc))
    # THEN it fits, says the search was cut at its bound and how much budget that may cost,
    # and checked few sets (the floor's bisection and the plan's answers), each met the rule
    assert summary["status"] == "fits"
    assert "not exact: the search reached its bound" in text and "for a budget" in text
    assert len(checked) <= 40
    monkeypatch.setattr(plan_solve, "peak_with", real)
    m = from_json(doc["measurement"])
    full = make_plan(m, budget=doc["asked"]["budget_bytes"])
    assert full["slack_bytes"] > 0 and not full["exact"]
    for p in [full["plan"], *full["runners_up"]]:
        assert predict(m, set(p["modules"]))["predicted_peak_bytes"] == p["predicted_peak_bytes"]
        assert p["predicted_peak_bytes"] <= full["budget_bytes"] - full["margin_bytes"]


def test_the_solver_matches_brute_force_on_random_instances():
    # GIVEN 300 random chains of up to 8 blocks and a target
    rng = random.Random(28)
    compared = 0
    for _ in range(300):
        c = chain(rng, rng.randint(1, 8))
        every, none = peak_with(c, range(len(c.freeable))), peak_with(c, [])
        target = rng.randint(min(every, none) - 10, max(every, none))
        # WHEN the DP solves it
        got, exact = solve(c, target)
        want = brute_force(c, target)
        # THEN it is exact, finds the cheapest set and the same runners-up costs, or says none
        assert exact
        if not want:
            assert got == []
            continue
        compared += 1
        assert [round(ch.cost, 9) for ch in got] == [round(x, 9) for x in want[: len(got)]]
        assert len(got) == min(4, len(want))
        for ch in got:
            assert ch.peak == peak_with(c, ch.blocks) <= target
            assert ch.freed == sum(c.freeable[i] for i in ch.blocks)
    assert compared > 100


@pytest.mark.parametrize("shared", [False, True], ids=["own-inputs", "shared-inputs"])
def test_the_solver_matches_brute_force_where_checkpoints_keep_their_inputs(shared):
    # GIVEN 300 random chains whose blocks' checkpoints keep inputs the step let go (shared:
    # some one storage of two blocks), and a target
    rng = random.Random(29)
    compared = 0
    for _ in range(300):
        c = chain(rng, rng.randint(1, 8), kept=True, shared=shared)
        every, none = peak_with(c, range(len(c.freeable))), peak_with(c, [])
        target = rng.randint(min(every, none) - 10, max(every, none))
        # WHEN the DP solves it
        got, exact = solve(c, target)
        want = brute_force(c, target)
        # THEN every answer meets the target by peak_with; where the search says it is exact
        # (no storage kept by two, no block freeing less than it keeps), it is brute force's
        for ch in got:
            assert ch.peak == peak_with(c, ch.blocks) <= target
        if not want:
            assert got == []
            continue
        if not exact:
            assert not got or round(got[0].cost, 9) >= round(want[0], 9)
            continue
        compared += 1
        assert [round(ch.cost, 9) for ch in got] == [round(x, 9) for x in want[: len(got)]]
        assert len(got) == min(4, len(want))
    assert compared > (30 if shared else 100)
