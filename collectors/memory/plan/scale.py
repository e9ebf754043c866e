"""The memory plan at other micro-batch sizes, from one measured step.

What a step holds beyond parameters, gradients and optimizer state (activations, the saved
tensors each block frees, temporaries, what a recompute rises by) grows with the tokens of the
step; parameters, gradients and optimizer state do not. :func:`scale` makes the measurement
of the same step with ``factor`` times its tokens: every level of its timeline keeps its
parameters, optimizer state and the gradients made by then (each block's from its backward's
start, the others' from the last block's), and the rest is multiplied; each block's freeable,
kept and recompute bytes, and its recompute time, are multiplied too (autocast's parameter
casts are not). The plan of a scaled measurement (:func:`collectors.memory.plan.solve.make_plan`) is
the plan for that size.

:func:`micro_batches` answers "which micro-batch fits": the largest size whose predicted peak,
without a plan and with one, is under the budget less the plan's margin, and the plan at twice
the measured size. The size is the first block's input's first dimension in the measured step
(``input_shape``), or, without it, a multiple of the measured step's tokens.

:func:`tokens_factor` reads, at an OOM, how many times the measured step's tokens the failing
step holds, from the shapes of the tensors the failing frames hold (the advice's scaling).

The CPU's meter checks it (tests/unit/test_collectors_memory_plan_scale.py): a step with twice
the batch measured for real is within 10 % of the prediction. Time scales with the tokens as
an estimate: a GPU under-filled by a small micro-batch does better than that.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

from collectors.memory.plan.measurement import Measurement, from_json
from collectors.memory.plan.predict import margin_bytes
from collectors.memory.plan.solve import make_plan
from dynprof.units import human_bytes as hb

MAX_SIZE_FACTOR = 64  # the largest micro-batch looked for, in multiples of the measured one
MAX_SHAPE_DIMS = 8


def input_shape(doc: dict[str, Any]) -> list[int]:
    """The measured step's first block input's shape (``[]`` when not recorded), bounded."""
    raw = doc.get("input_shape")
    if not isinstance(raw, list) or len(raw) > MAX_SHAPE_DIMS:
        return []
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 40 for d in raw):
        return []
    return list(raw)


def _grads_by_segment(m: Measurement) -> list[int]:
    """The gradient bytes the step's backward has made by each timeline segment, as far as the
    blocks tell. Gradients kept from the step before (a loop that zeroes them after its
    forward, or never sets them to None) are scaled with the rest: a prediction over, not under."""
    n = len(m.timeline)
    out = [0] * n
    blocks = [b for b in m.blocks if b.backward_start < n]
    in_blocks = sum(b.parameter_bytes for b in m.blocks)
    for b in blocks:
        for seg in range(max(0, b.backward_start), n):
            out[seg] += b.parameter_bytes
    if blocks:
        last = max(b.backward_start for b in blocks)
        rest = max(0, m.gradient_bytes - in_blocks)
        for seg in range(last, n):
            out[seg] += rest
    return out


def scale(m: Measurement, factor: float) -> Measurement:
    """The measurement of the same step with ``factor`` times its tokens (see the module)."""
    if not 0 < factor <= MAX_SIZE_FACTOR * 4:
        raise ValueError(f"a factor of {factor} tokens is out of range")
    s = copy.deepcopy(m)
    static = m.parameter_bytes + m.optimizer_state_bytes
    grads = _grads_by_segment(m)

    def level(x: int, seg: int) -> int:
        held = static + (grads[seg] if 0 <= seg < len(grads) else m.gradient_bytes)
        return x + int((factor - 1) * max(0, x - held))

    def times(x: int) -> int:
        return round(x * factor)

    s.timeline = [(level(a, i), level(b, i)) for i, (a, b) in enumerate(m.timeline)]
    for b in s.blocks:
        b.saved_bytes = times(b.saved_bytes)
        b.freeable_bytes = b.cast_bytes + times(max(0, b.freeable_bytes - b.cast_bytes))
        b.recompute_bytes = times(b.recompute_bytes)
        b.backward_start_bytes = level(b.backward_start_bytes, b.backward_start)
        b.late_freeable = [(seg, times(x)) for seg, x in b.late_freeable]
        b.kept_inputs = [(seg, times(x), group) for seg, x, group in b.kept_inputs]
        b.forward_s *= factor
        if b.recompute_s is not None:
            b.recompute_s *= factor
    s.activation_bytes = times(m.activation_bytes)
    s.unrecomputable_activation_bytes = times(m.unrecomputable_activation_bytes)
    s.temporary_bytes = times(m.temporary_bytes)
    s.untracked_bytes = times(m.untracked_bytes)
    if s.timeline:
        s.peak_bytes = max(max(t) for t in s.timeline) + s.untracked_bytes
    else:
        s.peak_bytes = static + m.gradient_bytes + times(max(0, m.peak_bytes - static - m.gradient_bytes))
    s.step_s = m.step_s * factor
    if m.typical_step_s:
        s.typical_step_s = m.typical_step_s * factor
    return s


def predicted_peak(m: Measurement, factor: float) -> int:
    """The step's peak with ``factor`` times its tokens, nothing recomputed."""
    return scale(m, factor).peak_bytes


def micro_batches(doc: dict[str, Any], budget: int) -> dict[str, Any]:
    """Which micro-batch fits ``budget``, from the measurement ``doc`` (its JSON): the largest
    size without a plan and with one, and the plan at twice the measured size."""
    m = from_json(doc)
    shape = input_shape(doc)
    measured = shape[0] if shape else 0
    unit = "micro-batch" if measured else "x the measured tokens"
    base = measured or 1

    def factor_of(size: int) -> float:
        return size / base

    def fits_plain(size: int) -> bool:
        s = scale(m, factor_of(size))
        return s.peak_bytes + margin_bytes(s) <= budget

    def plan_at(size: int) -> dict[str, Any]:
        return make_plan(scale(m, factor_of(size)), budget=budget)

    def fits_planned(size: int) -> bool:
        return plan_at(size)["status"] in ("fits", "fits-already")

    top = base * MAX_SIZE_FACTOR
    plain = _largest(fits_plain, 1, top)
    planned = _largest(fits_planned, max(plain, 1), top) if plain < top else plain
    out: dict[str, Any] = {
        "unit": unit,
        "measured_size": measured or None,
        "input_shape": shape,
        "budget_bytes": budget,
        "largest_without_plan": _row(m, plain, factor_of(plain), None) if plain else None,
        "largest_with_plan": _row(m, planned, factor_of(planned), plan_at(planned)) if planned else None,
    }
    double = 2 * base
    out["at_twice"] = _row(m, double, 2.0, plan_at(double))
    return out


def _largest(fits: Any, lo: int, hi: int) -> int:
    """The largest size in [lo, hi] that ``fits`` (monotone), 0 when none does."""
    if not fits(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _row(m: Measurement, size: int, factor: float, plan: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "size": size,
        "tokens_factor": round(factor, 4),
        "predicted_peak_bytes": predicted_peak(m, factor),
    }
    if plan is not None:
        chosen = plan.get("plan") or {}
        step = (m.typical_step_s or m.step_s) * factor
        row["plan"] = {
            "status": plan["status"],
            "modules": list(chosen.get("modules") or []),
            "predicted_peak_bytes": chosen.get("predicted_peak_bytes"),
            "added_step_s": chosen.get("added_step_s"),
            "added_step_fraction": round(chosen["added_step_s"] / step, 4) if chosen and step else None,
            "floor_bytes": plan.get("floor_bytes"),
        }
    return row


def tokens_factor(shape: list[int], held: Iterable[Any]) -> float | None:
    """How many times the measured step's tokens the failing step holds: the largest ratio of
    a held tensor's leading dimensions to those of the measured first block's input (``shape``),
    over the held tensors of the same rank and last dimension; None when none compares."""
    if len(shape) < 2:
        return None
    base = math.prod(shape[:-1])
    best: float | None = None
    for t in held:
        got = t.get("shape") if isinstance(t, dict) else None
        if not isinstance(got, list) or len(got) != len(shape) or got[-1] != shape[-1]:
            continue
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in got):
            continue
        ratio = math.prod(got[:-1]) / base
        best = ratio if best is None else max(best, ratio)
    return best


def describe(doc: dict[str, Any]) -> list[str]:
    """The text of :func:`micro_batches`' answer ``doc``."""
    unit, budget = doc["unit"], doc["budget_bytes"]

    def size(row: dict[str, Any]) -> str:
        return f"a micro-batch of {row['size']}" if unit == "micro-batch" else f"{row['tokens_factor']:g}x the tokens"

    lines = [f"micro-batch sizes, scaled from the measured step (activations grow with its tokens), for {hb(budget)}:"]
    plain = doc.get("largest_without_plan")
    lines.append(
        f"  {size(plain)} fits without recomputation (predicted {hb(plain['predicted_peak_bytes'])})"
        if plain
        else "  no size fits without recomputation"
    )
    planned = doc.get("largest_with_plan")
    if planned and planned.get("plan") and planned["plan"]["modules"]:
        p = planned["plan"]
        frac = p.get("added_step_fraction")
        lines.append(
            f"  {size(planned)} fits with {blocks_text(p['modules'])} recomputed (predicted "
            f"{hb(p['predicted_peak_bytes'])}"
            + (f", +{frac * 100:.0f} % step time" if frac is not None else "")
            + f" for {planned['tokens_factor']:g}x the tokens)"
        )
    twice = doc.get("at_twice") or {}
    p = twice.get("plan") or {}
    if p.get("status") == "fits" and p.get("modules"):
        lines.append(
            f"  {size(twice)}: peak {hb(twice['predicted_peak_bytes'])}; fits with {blocks_text(p['modules'])} recomputed "
            f"(predicted {hb(p['predicted_peak_bytes'])}, +{(p.get('added_step_fraction') or 0) * 100:.0f} % step time "
            "for 2x the tokens)"
        )
    elif p.get("status") == "fits-already":
        lines.append(f"  {size(twice)}: peak {hb(twice['predicted_peak_bytes'])}, fits as it is")
    elif p:
        lines.append(
            f"  {size(twice)}: peak {hb(twice['predicted_peak_bytes'])}; no recomputation fits it "
            f"(the floor is {hb(p.get('floor_bytes') or 0)})"
        )
    return lines


def blocks_text(names: list[str]) -> str:
    """``blocks 2-19`` for a run of one container's numbered blocks, else the names."""
    heads = {n.rsplit(".", 1)[0] for n in names}
    tails = [n.rsplit(".", 1)[-1] for n in names]
    if len(heads) == 1 and len(names) > 2 and all(t.isdigit() for t in tails):
        nums = sorted(int(t) for t in tails)
        if nums == list(range(nums[0], nums[-1] + 1)):
            return f"{heads.pop()} {nums[0]}-{nums[-1]}"
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
