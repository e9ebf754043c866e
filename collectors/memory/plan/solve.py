"""The memory plan: which blocks to recompute in backward to bring a step's peak under a budget.

The plan is the set of blocks whose checkpointing brings the predicted peak
(:func:`collectors.memory.plan.predict.peak_with`) under the budget less a margin (or saves the
asked bytes) at the least added recompute time, found by dynamic programming over the blocks
in forward order (:func:`solve`). The search is bounded whatever the measurement (it may come
from a hostile node: ``ls --fetch``): it extends at most :data:`WORK` states (under a second for
4 096 crafted blocks with every entry the decoder allows, scripts/bench_plan_solver.py); beyond
that it merges alike states, says the plan is not exact and how many bytes of budget it may
have given away; every set it answers is checked by the predicted-peak rule.

**The floor** (:func:`floor_bytes`). The least predicted peak any set of blocks reaches, and
never under parameters, gradients and optimizer state. A budget under it gets that answer with
the options beyond recomputation and what each would save (:func:`beyond_recompute`).

:func:`make_plan` is the plan's document. This module needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collectors.memory.plan.measurement import PLAN_SCHEMA, Measurement
from collectors.memory.plan.predict import Candidates, Choice, candidates, margin_bytes, peak_with
from collectors.memory.plan.recipes import how_to_apply

# The most states one solve extends, over all candidates: it bounds the search's time and memory
# whatever the measurement (scripts/bench_plan_solver.py); beyond it, solve merges alike states.
WORK = 60_000
MAX_CHECKS = 16  # sets the search found that peak_with checks beyond those it keeps
MIN_KEYS = 8  # keys kept after each candidate, however many candidates
RUNNERS_UP = 3


def _prefix_lengths(c: Candidates) -> tuple[list[int], bool]:
    """For each segment, how many candidates (in forward order) are held in it if all are
    chosen, and whether each segment's held set is a prefix of the forward order (a chain of
    blocks, backward in reverse: then :func:`solve` is exact)."""
    n = len(c.timeline)
    count = [0] * (n + 1)
    for j in range(len(c.freeable)):
        lo, hi = c.forward_end[j], c.backward_start[j]
        if lo < hi:
            count[lo] += 1
            count[hi] -= 1
    out = []
    held = 0
    for i in range(n):
        held += count[i]
        out.append(held)
    # forward ends in forward order and backward starts in reverse: every held set is a prefix
    fe, bs = c.forward_end, c.backward_start
    exact = all(fe[j] <= fe[j + 1] and bs[j] >= bs[j + 1] for j in range(len(fe) - 1))
    return out, exact


def _kept_rule(c: Candidates) -> tuple[list[int], list[int], bool]:
    """For each candidate, the bytes of its inputs its checkpoint keeps and the segment they
    die in (the first; ``len(c.timeline)`` where none), and whether :func:`solve` counts them
    as :func:`peak_with` does. The search counts a candidate's kept inputs in every segment from
    its forward end through its backward's, less in the segments before they die while it is
    the last candidate held; a storage kept by several candidates for each of them, and
    inputs that outlive the next candidate's forward from its forward end: more than
    :func:`peak_with` holds (the search is then not exact, never too lenient)."""
    n = len(c.freeable)
    segments = len(c.timeline)
    kept = [0] * n
    since = [segments] * n
    exact = True
    users: dict[int, int] = {}
    for j in range(min(n, len(c.kept))):
        for seg, size, group in c.kept[j]:
            kept[j] += size
            if since[j] != segments and seg != since[j]:
                exact = False
            since[j] = min(since[j], seg)
            users[group] = users.get(group, 0) + 1
    if any(u > 1 for u in users.values()):
        exact = False
    for j in range(n - 1):
        if kept[j] and since[j] > c.forward_end[j + 1]:
            exact = False
    if any(kept[j] > c.freeable[j] - c.casts[j] for j in range(n)):
        exact = False  # a state may shrink: where it was capped, the search counts less than it frees
    return kept, since, exact


@dataclass(frozen=True)
class _Rules:
    """What :func:`solve` reads of the candidates whatever the target: each constraint as the
    level it holds the chosen to (the target is taken off it per solve). ``NONE``: no constraint."""

    exact: bool  # the search is exact for these candidates (see _prefix_lengths, _kept_rule)
    kept: list[int]  # per candidate: the bytes of the inputs its checkpoint keeps
    level_plain: list[int]  # per m: the highest level of the segments whose held set is the first m
    level_cached: list[int]  # the same, while autocast's cache is on
    before_plain: list[int]  # per candidate j: its segments before its inputs' death, j the last held
    before_cached: list[int]
    gate_plain: list[int]  # per candidate k: its recompute, and its backward's segment
    gate_cached: list[int]
    top_plain: int  # the highest of all, less nothing: what no state needs to free more than
    top_cached: int


_NONE = -(1 << 100)  # a constraint that none is: below any state, whatever the target


def _rules(c: Candidates) -> _Rules:
    """The candidates' :class:`_Rules`, made once (a plan solves for many targets)."""
    got = c.rules
    if isinstance(got, _Rules):
        return got
    n = len(c.freeable)
    prefix, exact = _prefix_lengths(c)
    kept, since, kept_exact = _kept_rule(c)
    level_plain = [_NONE] * (n + 1)
    level_cached = [_NONE] * (n + 1)
    before_plain = [_NONE] * n
    before_cached = [_NONE] * n
    for i, (lp, lc) in enumerate(c.timeline):
        m = prefix[i]
        j = m - 1
        if 0 <= j < n and kept[j] and c.forward_end[j] <= i < since[j]:
            before_plain[j] = max(before_plain[j], lp)
            before_cached[j] = max(before_cached[j], lc)
        else:
            level_plain[m] = max(level_plain[m], lp)
            level_cached[m] = max(level_cached[m], lc)
    # taking candidate k: the chosen before it must free this much (its own bytes are held too,
    # its inputs kept) for its recompute, and for its backward's segment (its inputs still kept)
    gate_plain = [c.recompute_peak[k] - c.freeable[k] + kept[k] for k in range(n)]
    gate_cached = [_NONE] * n
    for k in range(n):
        b = c.backward_start[k]
        if kept[k] and 0 <= b < len(c.timeline):
            lp, lc = c.timeline[b]
            if lp:
                gate_plain[k] = max(gate_plain[k], lp + kept[k])
            if lc:
                gate_cached[k] = lc + kept[k]
    rules = _Rules(
        exact=exact and kept_exact,
        kept=kept,
        level_plain=level_plain,
        level_cached=level_cached,
        before_plain=before_plain,
        before_cached=before_cached,
        gate_plain=gate_plain,
        gate_cached=gate_cached,
        top_plain=max([*level_plain, *gate_plain, *before_plain]),
        top_cached=max([*level_cached, *gate_cached, *before_cached]),
    )
    c.rules = rules
    return rules


# A state of the search: its cost and the chosen candidates as a linked list, last first
# ((index, rest) or None), so that a state grows by one candidate in constant time and memory.
_Chosen = tuple[int, Any] | None
_State = tuple[float, _Chosen]
_Front = dict[tuple[int, int], list[_State]]


def _chosen(node: _Chosen) -> tuple[int, ...]:
    out = []
    while node is not None:
        out.append(node[0])
        node = node[1]
    return tuple(reversed(out))


def _cheapest(states: list[_State], keep: int) -> list[_State]:
    """The ``keep`` cheapest of ``states``, one of each cost: two of one cost in one state
    (equal blocks in another order) are one alternative."""
    if len(states) == 1:
        return states
    states.sort(key=_cost)
    out = [states[0]]
    last = states[0][0]
    for s in states:
        if len(out) >= keep:
            break
        if s[0] - last > 1e-9:
            out.append(s)
            last = s[0]
    return out


def _cost(state: _State) -> float:
    return state[0]


def solve(
    c: Candidates,
    target: int,
    keep: int = 1 + RUNNERS_UP,
    work: int = WORK,
    info: dict[str, int] | None = None,
) -> tuple[list[Choice], bool]:
    """The cheapest sets of candidates whose :func:`peak_with` is at most ``target``, cheapest
    first (at most ``keep``, no two of equal cost and equal peak freeing the same bytes), and
    whether the search was exact.

    Dynamic programming over the candidates in forward order. Each segment's constraint is a
    lower bound on the bytes freed by the chosen candidates held in it: with the blocks in a
    chain (backward in reverse order), those are the chosen among the first m, so the state
    after deciding the first m is the bytes they free less the inputs they keep (with
    autocast's casts, and without), capped where no constraint asks for more; a segment whose
    held set is the first m is checked there; a candidate's recompute and its backward's
    segment (where its inputs are still kept, its bytes no longer freed) when it is taken; the
    segments from its forward end to its inputs' death (freed, not kept yet) when it is
    decided (:func:`_kept_rule`). Of the states of one key, the ``keep`` cheapest are kept, one
    of each cost (equal blocks in another order are one alternative).

    **Bounded whatever the candidates.** The keys kept after each candidate are at most
    ``work / ((candidates + 1) * keep)`` (and :data:`MIN_KEYS`), so a solve extends at most
    about ``work`` states. Beyond it, the states that ``keep`` others beat (as many bytes freed
    of both kinds or more, for no more time) are dropped; if still too many, states whose bytes
    differ by less than a width are merged into one cell, under its least bytes of each kind
    (never overstated), the cell's cheapest kept, and the search is not exact. A merge takes
    less than its width off the bytes freed on the way to any answer, so the cheapest answer
    costs no more than the cheapest set that meets ``target`` less the widths summed
    (``info["slack_bytes"]``; checked against brute force). Every answer is checked with
    :func:`peak_with` (at most ``keep + MAX_CHECKS`` sets): a returned set always meets the target."""
    n = len(c.freeable)
    if c.static > target:
        return [], True
    rules = _rules(c)
    exact = rules.exact
    t = target - c.untracked
    need_plain = [v - t for v in rules.level_plain]
    need_cached = [v - t for v in rules.level_cached]
    before_plain = [v - t for v in rules.before_plain]
    before_cached = [v - t for v in rules.before_cached]
    gate_plain = [v - t for v in rules.gate_plain]
    gate_cached = [v - t for v in rules.gate_cached]
    cap_p = max(0, rules.top_plain - t)
    cap_c = max(0, rules.top_cached - t)
    limit = max(MIN_KEYS, work // ((n + 1) * keep))
    slack = 0
    front: _Front = {(0, 0): [(0.0, None)]}
    for m in range(n + 1):
        front = {k: v for k, v in front.items() if k[0] >= need_plain[m] and k[1] >= need_cached[m]}
        if m == n or not front:
            break
        f, fc, sec, km = c.freeable[m], c.freeable[m] - c.casts[m], c.seconds[m], rules.kept[m]
        gp, gc, bp, bc = gate_plain[m], gate_cached[m], before_plain[m], before_cached[m]
        add: _Front = {}
        for (fp, fcc), states in front.items():
            if fp < gp or fcc < gc or fp + f < bp or fcc + fc < bc:
                continue
            key = (min(cap_p, fp + f - km), min(cap_c, fcc + fc - km))
            grown: list[_State] = [(cost + sec, (m, node)) for cost, node in states]
            got = add.get(key)
            if got is None:
                add[key] = grown
            else:
                got.extend(grown)
        # not taking it: its segments before its inputs' death as measured, less the chosen before
        front = {k: v for k, v in front.items() if k[0] >= bp and k[1] >= bc}
        for key, states in add.items():
            old = front.get(key)
            front[key] = _cheapest(states if old is None else old + states, keep)
        if len(front) > limit:
            if not slack:  # (once merged, merging again keeps the cheapest: no need to look for the beaten)
                front = _prune(front, keep)
            if len(front) > limit:
                front, width = _merge(front, limit, keep, (cap_p, cap_c))
                slack += width
                exact = False
    ordered = sorted((s for states in front.values() for s in states), key=lambda s: s[0])
    found: list[Choice] = []
    seen: set[tuple[float, int, int]] = set()
    checks = 0
    for cost, node in ordered:
        if len(found) >= keep and round(cost, 9) > round(found[keep - 1].cost, 9):
            break
        if checks >= keep + MAX_CHECKS:
            exact = False
            break
        checks += 1
        chosen = _chosen(node)
        peak = peak_with(c, chosen)
        if peak > target:
            continue
        freed = sum(c.freeable[i] for i in chosen)
        alike = (round(cost, 9), peak, freed)
        if alike not in seen:
            seen.add(alike)
            found.append(Choice(chosen, freed, cost, peak))
            found.sort(key=lambda ch: (ch.cost, ch.peak, len(ch.blocks), ch.blocks))
    if info is not None:
        info["slack_bytes"] = slack
    return found[:keep], exact


def _merge(front: _Front, limit: int, keep: int, cap: tuple[int, int]) -> tuple[_Front, int]:
    """``front`` in at most ``limit`` cells of bytes freed (of both kinds): each cell's
    ``keep`` cheapest states under its least bytes of each kind (what they free is never
    overstated: a merged state meets no constraint the states in it did not); and the width
    of the cells (a merged state frees less than one it replaced by less than it). A kind at
    its ``cap`` (no constraint asks for more) is a cell of its own: it stays at the cap."""
    lo_p = min(k[0] for k in front)
    lo_c = min(k[1] for k in front)
    span = max(max(k[0] for k in front) - lo_p, max(k[1] for k in front) - lo_c)
    width = span // max(1, limit // 2) + 1
    while True:
        cells: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for p, c in front:
            cell = (-1 if p >= cap[0] else (p - lo_p) // width, -1 if c >= cap[1] else (c - lo_c) // width)
            cells.setdefault(cell, []).append((p, c))
        if len(cells) <= limit or width > span:  # (then at most four: at the caps or not)
            break
        width *= 2
    out: _Front = {}
    for keys in cells.values():
        least = (min(k[0] for k in keys), min(k[1] for k in keys))
        pooled = [s for key in keys for s in front[key]]
        old = out.get(least)
        out[least] = _cheapest(pooled if old is None else old + pooled, keep)
    return out, width


def _prune(front: _Front, keep: int) -> _Front:
    """Drop the states that ``keep`` others beat: as many bytes freed of both kinds or more, for
    no more time. A sweep by the first kind, descending, over a Fenwick tree indexed by the
    second kind (descending) whose nodes keep their ``keep`` cheapest costs."""
    if len(front) <= 1:
        return front
    seconds = sorted({k[1] for k in front}, reverse=True)
    rank = {v: i + 1 for i, v in enumerate(seconds)}
    size = len(seconds)
    tree: list[list[float]] = [[] for _ in range(size + 1)]
    out: _Front = {}
    keys = sorted(front, reverse=True)
    i = 0
    while i < len(keys):
        # states of equal first kind are judged against those strictly ahead and each other
        j = i
        while j < len(keys) and keys[j][0] == keys[i][0]:
            j += 1
        group = keys[i:j]
        for key in group:
            r = rank[key[1]]
            better: list[float] = []
            x = r
            while x > 0:
                better = sorted(better + tree[x])[:keep]
                x -= x & -x
            limit = better[keep - 1] if len(better) >= keep else float("inf")
            states = [st for st in front[key] if st[0] <= limit]
            if states:
                out[key] = states
        for key in group:
            if key not in out:
                continue
            x = rank[key[1]]
            costs = [st[0] for st in out[key]]
            while x <= size:
                tree[x] = sorted(tree[x] + costs)[:keep]
                x += x & -x
        i = j
    return out


def floor_bytes(m: Measurement, c: Candidates | None = None, info: dict[str, Any] | None = None) -> int:
    """The lowest predicted peak checkpointing reaches: the least :func:`peak_with` over the
    sets of candidates (found by bisection with :func:`solve`; every candidate checkpointed
    where that is lower), never under what parameters, gradients and optimizer state hold.

    The bisection's searches share :data:`WORK`: where one was cut at its bound, the floor is
    the lowest peak of a set found (reached, maybe not the least) and ``info["exact"]`` False."""
    c = candidates(m) if c is None else c
    n = len(c.freeable)
    every = peak_with(c, range(n)) if n else max(m.peak_bytes, c.static)
    lo, hi = c.static, min(every, peak_with(c, ()))
    exact = True
    if n and lo < hi:
        step = max(64, (hi - lo) // 4096)
        share = WORK // (4 * max(1, (hi - lo).bit_length() - step.bit_length() + 1))
        while hi - lo > step:
            mid = (lo + hi) // 2
            got, done = solve(c, mid, keep=1, work=share)
            exact = exact and done
            if got:
                hi = got[0].peak
            else:
                lo = mid + 1
    if info is not None:
        info["exact"] = exact
    return max(hi, c.static)


def make_plan(
    m: Measurement, budget: int | None = None, save: int | None = None, measurement: bool = True
) -> dict[str, Any]:
    """The plan's document (``--json``): the chosen blocks, the predicted peak and step-time
    increase, the runners-up, the floor, and how to apply it (``measurement`` False: the
    measurement in it without its blocks and timeline, as the text shows it).

    The plan aims under ``budget`` less a margin (:func:`margin_bytes`): the predicted peak
    of the chosen set is at most ``budget - margin``."""
    if (budget is None) == (save is None):
        raise ValueError("give exactly one of budget and save")
    if (budget if budget is not None else save or 0) < 0 or (save or 0) > m.peak_bytes:
        raise ValueError("a budget under 0, or a saving beyond the measured peak")
    need = (m.peak_bytes - budget) if budget is not None else int(save or 0)
    target = budget if budget is not None else m.peak_bytes - need
    margin = margin_bytes(m)
    c = candidates(m)
    step = m.typical_step_s or m.step_s
    searched: dict[str, int] = {}
    if need <= 0:
        choices, exact = [Choice((), 0, 0.0, m.peak_bytes)], True
    else:
        choices, exact = solve(c, target - margin, info=searched)
        n = len(c.freeable)
        if not choices and not exact and n:
            # the search, cut at its bound, found none: every candidate, if that meets the rule
            every = peak_with(c, range(n))
            if every <= target - margin:
                choices = [Choice(tuple(range(n)), sum(c.freeable), sum(c.seconds), every)]

    def describe(ch: Choice) -> dict[str, Any]:
        names = [m.blocks[c.index[i]].name for i in ch.blocks]
        return {
            "modules": names,
            "freed_bytes": ch.freed,
            "saved_bytes": max(0, m.peak_bytes - ch.peak),
            "predicted_peak_bytes": ch.peak,
            "added_step_s": round(ch.cost, 6),
            "added_step_fraction": round(ch.cost / step, 4) if step else None,
        }

    floored: dict[str, Any] = {}
    floor = floor_bytes(m, c, floored)
    doc: dict[str, Any] = {
        "schema": PLAN_SCHEMA,
        "measurement": m.to_json(blocks=measurement),
        "budget_bytes": target,
        "need_bytes": max(need, 0),
        "margin_bytes": margin,
        # False: a search was cut at its bound (WORK): the plan and the floor are sets that meet
        # the rule, maybe not the cheapest and the lowest; the plan is no dearer than the
        # cheapest for a budget slack_bytes lower
        "exact": exact and floored["exact"],
        "slack_bytes": searched.get("slack_bytes", 0),
        "floor_bytes": floor,
        "candidates": len(c.index),
    }
    if choices:
        doc["status"] = "fits" if choices[0].blocks else "fits-already"
        doc["plan"] = describe(choices[0])
        doc["runners_up"] = [describe(ch) for ch in choices[1:]]
        doc["apply"] = how_to_apply(m, doc["plan"]["modules"])
    else:
        doc["status"] = "unreachable"
        doc["plan"] = None
        doc["runners_up"] = []
        doc["beyond"] = beyond_recompute(m, floor, target)
    return doc


def beyond_recompute(m: Measurement, floor: int, target: int) -> list[dict[str, Any]]:
    """What else would take memory off the floor, with the figure each saves."""
    opt_grad = m.optimizer_state_bytes + m.gradient_bytes
    half_act = m.activation_bytes // 2
    return [
        {
            "option": "shard the optimizer state and gradients across N data-parallel ranks "
            "(ZeRO-2 / FSDP SHARD_GRAD_OP; ZeRO-3 / FSDP FULL_SHARD shards the parameters too)",
            "saves_bytes_with_8_ranks": opt_grad * 7 // 8,
            "saves_bytes_with_8_ranks_full_shard": (opt_grad + m.parameter_bytes) * 7 // 8,
        },
        {
            "option": "offload the optimizer state to host memory (DeepSpeed offload_optimizer, FSDP CPUOffload)",
            "saves_bytes": m.optimizer_state_bytes,
        },
        {
            "option": "halve the micro-batch (and double gradient accumulation to keep the batch)",
            "saves_bytes": half_act,
        },
        {
            "option": "the floor with recomputation of every block",
            "floor_bytes": floor,
            "short_by_bytes": floor - target,
        },
    ]
