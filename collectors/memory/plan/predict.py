"""The memory plan's predicted peak: the step's peak with a set of blocks checkpointed.

**The predicted peak** (:func:`peak_with`). Checkpointing block j takes its freeable bytes out
of every timeline segment from its forward end to its backward start (less, while autocast is
on, its cached parameter casts; and bytes that others saved too only from when they are done
with them), and adds its inputs that the step let go before its backward (a checkpoint keeps
them to recompute from) from the segment they died in through its backward start's. At its
backward start it recomputes: from the level measured there, less the chosen blocks' bytes held
then, plus the inputs kept then, it rises by what its forward rose up to its last saved tensor
(where a non-reentrant checkpoint stops recomputing). The predicted peak is the highest of all,
plus what the allocator's peak held beyond the levels seen (``untracked_bytes``). On the CPU
harness it is the real peak to the byte (scripts/bench_memory_plan.py --device cpu).

**The margin** (:func:`margin_bytes`): each uncertainty counted once. 1 % of the peak above
parameters, gradients and optimizer state, and on CUDA how far the measured levels fell *short*
of the allocator's count between two block events (memory no operator returned: the levels may
have been low by it). Levels that went *over* the allocator's count (a storage the meter did not
follow died) are high already: counted again in the margin, the plan aimed twice under the
budget for one error (seen: a decoder's 1000 MiB bf16 logits, kept in a variable across steps).

Recompute time is each block's measured forward up to its last saved tensor. This module needs
no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.memory.plan.measurement import Measurement

# The share of the peak above parameters, gradients and optimizer state that a plan keeps under
# the budget beyond its predicted peak. On the CPU harness (scripts/bench_memory_plan.py --device
# cpu, and a Hugging Face Llama) predictions matched the real peak to the byte, or were short
# by at most 0.02 % (a Llama's RMSNorm output held a little longer); 1 % leaves room for what one
# measured step cannot see: a kernel's workspace where the peak statistic cannot be reset, a
# step whose shapes differ.
MARGIN = 0.01


@dataclass(frozen=True)
class Choice:
    blocks: tuple[int, ...]  # indices into the candidates, in forward order
    freed: int  # sum of the candidates' freeable bytes
    cost: float  # sum of their recompute seconds
    peak: int  # the predicted peak with them checkpointed (:func:`peak_with`)


@dataclass
class Candidates:
    """The blocks a plan may choose (not checkpointed already, freeing something), in forward
    order, with the timeline: what :func:`peak_with` and :func:`.solve.solve` work on."""

    index: list[int]  # into Measurement.blocks
    freeable: list[int]
    casts: list[int]
    seconds: list[float]
    forward_end: list[int]
    backward_start: list[int]
    recompute_peak: list[int]  # the level its recompute would reach, all its bytes held before it
    late: list[list[tuple[int, int]]]  # (segment, bytes) freed from then on (see Block.late_freeable)
    timeline: list[tuple[int, int]]
    untracked: int
    static: int
    # (segment, bytes, group) its checkpoint keeps from then on (see Block.kept_inputs)
    kept: list[list[tuple[int, int, int]]] = field(default_factory=list)
    rules: Any = field(default=None, repr=False, compare=False)  # made by solve, once


def candidates(m: Measurement) -> Candidates:
    idx = [i for i, b in enumerate(m.blocks) if not b.checkpointed and b.freeable_bytes > 0 and b.calls > 0]
    bs = [m.blocks[i] for i in idx]
    return Candidates(
        index=idx,
        freeable=[b.freeable_bytes for b in bs],
        casts=[b.cast_bytes for b in bs],
        seconds=[b.seconds for b in bs],
        forward_end=[b.forward_end for b in bs],
        backward_start=[b.backward_start for b in bs],
        recompute_peak=[b.backward_start_bytes + max(b.recompute_bytes, b.freeable_bytes) for b in bs],
        late=[list(b.late_freeable) for b in bs],
        timeline=list(m.timeline),
        untracked=m.untracked_bytes,
        static=_static(m),
        kept=[list(b.kept_inputs) for b in bs],
    )


def _kept_ranges(c: Candidates, chosen: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """group -> (first segment, last segment, bytes) that the ``chosen`` candidates' checkpoints
    keep of their inputs: a storage several of them took is kept once, from the segment it
    died in the step measured until the backward of the last of them to run backward (the
    latest backward start)."""
    last = len(c.timeline) - 1
    out: dict[int, tuple[int, int, int]] = {}
    for j in chosen:
        if j >= len(c.kept):
            continue
        end = min(c.backward_start[j], last)
        for seg, size, group in c.kept[j]:
            got = out.get(group)
            out[group] = (seg, end, size) if got is None else (min(got[0], seg), max(got[1], end), got[2])
    return out


def peak_with(c: Candidates, chosen: Sequence[int], where: dict[str, int] | None = None) -> int:
    """The predicted peak of the step with the candidates ``chosen`` checkpointed.

    Checkpointing block j takes its freeable bytes out of every segment from its forward end to
    its backward start (less, while autocast's cache is on, the parameter casts it saved: the
    cache holds them until autocast exits). It keeps its inputs that the step let go before its
    backward (nothing saved them: a LayerNorm that saves a float32 copy of a bf16 input), from
    the segment they died in through its backward's segment. At its backward start it
    recomputes: from the level measured there less the chosen blocks' bytes held then (its own
    among them), with the inputs kept then, it rises by what its forward rose up to its last
    saved tensor. The highest of all, plus what the allocator's peak held beyond the levels
    seen after each operator (``untracked``), never under parameters, gradients and optimizer
    state.

    ``where``, when given, is filled with where that highest level is: the ``segment``, the
    candidate whose ``recompute`` it is (-1: none), the level ``measured`` there, the bytes the
    chosen ``freed`` and ``kept`` there, and ``autocast`` (1: the level of operators run while
    autocast's cache was on)."""
    n = len(c.timeline)
    plain = [0] * (n + 1)
    cached = [0] * (n + 1)
    kept = [0] * (n + 1)
    for j in chosen:
        lo, hi = c.forward_end[j], c.backward_start[j]
        if lo < hi:
            plain[lo] += c.freeable[j]
            plain[hi] -= c.freeable[j]
            cached[lo] += c.freeable[j] - c.casts[j]
            cached[hi] -= c.freeable[j] - c.casts[j]
        for start, size in c.late[j]:
            if start < hi:
                plain[start] += size
                plain[hi] -= size
                cached[start] += size
                cached[hi] -= size
    for first, last, size in _kept_ranges(c, chosen).values():
        if first <= last:
            kept[first] += size
            kept[last + 1] -= size
    best = 0
    held_plain = held_cached = held_kept = 0
    held_at: list[int] = []
    kept_at: list[int] = []
    for i, (lp, lc) in enumerate(c.timeline):
        held_plain += plain[i]
        held_cached += cached[i]
        held_kept += kept[i]
        held_at.append(held_plain)
        kept_at.append(held_kept)
        if lp and lp - held_plain + held_kept > best:
            best = lp - held_plain + held_kept
            if where is not None:
                where.update(segment=i, recompute=-1, measured=lp, freed=held_plain, kept=held_kept, autocast=0)
        if lc and lc - held_cached + held_kept > best:
            best = lc - held_cached + held_kept
            if where is not None:
                where.update(segment=i, recompute=-1, measured=lc, freed=held_cached, kept=held_kept, autocast=1)
    for k in chosen:
        i = c.backward_start[k] - 1
        held = held_at[i] if 0 <= i < n else 0
        # the inputs kept while it recomputes: its own, and those of the chosen before it
        more = kept_at[min(i + 1, n - 1)] if n else 0
        if c.recompute_peak[k] - held + more > best:
            best = c.recompute_peak[k] - held + more
            if where is not None:
                where.update(
                    segment=c.backward_start[k],
                    recompute=k,
                    measured=c.recompute_peak[k],
                    freed=held,
                    kept=more,
                    autocast=0,
                )
    return max(best + c.untracked, c.static)


def _static(m: Measurement) -> int:
    return m.parameter_bytes + m.gradient_bytes + m.optimizer_state_bytes


def margin_bytes(m: Measurement) -> int:
    """What a plan keeps under the budget beyond its predicted peak: :data:`MARGIN` of the peak
    above parameters, gradients and optimizer state, and the most the measured levels fell short
    of the allocator's own count between two block events (on CUDA: memory no operator
    returned; none on the CPU, where the levels are the live tensor bytes). Levels that went over
    the allocator's count (``drift_over_bytes``) are in the measured peak already and are not
    counted again."""
    return int(MARGIN * max(0, m.peak_bytes - _static(m))) + m.drift_bytes


def predict(m: Measurement, modules: set[str]) -> dict[str, Any]:
    """The predicted peak and added step time of checkpointing exactly ``modules`` (blocks of
    ``m`` by name; others are ignored), by the rule the plan is held to."""
    c = candidates(m)
    chosen = [j for j, i in enumerate(c.index) if m.blocks[i].name in modules]
    where: dict[str, int] = {}
    peak = peak_with(c, chosen, where)
    at: dict[str, Any] = {}
    if where:
        k = where["recompute"]
        at = {
            "segment": where["segment"],
            "recompute_of": m.blocks[c.index[k]].name if k >= 0 else None,
            "autocast": bool(where["autocast"]),
            "measured_bytes": where["measured"],
            "freed_bytes": where["freed"],
            "kept_input_bytes": where["kept"],
            "untracked_bytes": c.untracked,
        }
    return {
        "modules": [m.blocks[c.index[j]].name for j in chosen],
        "predicted_peak_bytes": peak,
        "added_step_s": round(sum(c.seconds[j] for j in chosen), 6),
        # where the predicted peak is: measured there, less freed, plus kept, plus untracked
        # (none when parameters, gradients and optimizer state are the floor)
        "peak_at": at if at and peak > c.static else None,
    }
