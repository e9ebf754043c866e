"""The memory plan: which blocks to recompute in backward to bring a step's peak under a budget.

The input is one measured step (:mod:`.plan_capture`, in the training process): each block's
freeable saved-tensor bytes, recompute time and events, the step's memory *timeline* (its
highest level between block events), the peak and its parts. The plan is the set of blocks
whose checkpointing brings the predicted peak under the budget less a margin (or saves the
asked bytes) at the least added recompute time, found by dynamic programming over the blocks
in forward order (:func:`solve`). The search is bounded whatever the measurement (it may come
from a hostile node: ``ls --fetch``): it extends at most :data:`WORK` states (under a second for
4 096 crafted blocks with every entry the decoder allows, scripts/bench_plan_solver.py); beyond
that it merges alike states, says the plan is not exact and how many bytes of budget it may
have given away; every set it answers is checked by the predicted-peak rule.

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

**The floor.** The least predicted peak any set of blocks reaches, and never under parameters,
gradients and optimizer state. A budget under it gets that answer with the options beyond
recomputation and what each would save.

Recompute time is each block's measured forward up to its last saved tensor.

This module needs no torch: the CLI plans from the agent's answer, the benchmark in-process.
:func:`from_json` is the one decoder of a measurement, bounded (it comes from a process); it
reads the first schema too (no timeline: the rule it was planned with is rebuilt from it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynprof.errors import ArtifactError

SCHEMA = 2
PLAN_SCHEMA = 1
MAX_BLOCKS = 4096
MAX_SEGMENTS = 5 * MAX_BLOCKS + 64
MAX_LATE = 64
MAX_KEPT = 64
# late_freeable and kept_inputs entries of all blocks together: each predicted peak walks those of
# the chosen (a real step has a few per block; 64 for each of 4 096 blocks would cost seconds a plan)
MAX_ENTRIES = 8 * MAX_BLOCKS
# The share of the peak above parameters, gradients and optimizer state that a plan keeps under
# the budget beyond its predicted peak. On the CPU harness (scripts/bench_memory_plan.py --device
# cpu, and a Hugging Face Llama) predictions matched the real peak to the byte, or were short
# by at most 0.02 % (a Llama's RMSNorm output held a little longer); 1 % leaves room for what one
# measured step cannot see: a kernel's workspace where the peak statistic cannot be reset, a
# step whose shapes differ.
MARGIN = 0.01
# The most states one solve extends, over all candidates: it bounds the search's time and memory
# whatever the measurement (scripts/bench_plan_solver.py); beyond it, solve merges alike states.
WORK = 60_000
MAX_CHECKS = 16  # sets the search found that peak_with checks beyond those it keeps
MIN_KEYS = 8  # keys kept after each candidate, however many candidates
MAX_BYTES = 1 << 60
RUNNERS_UP = 3


@dataclass
class Block:
    name: str
    cls: str
    saved_bytes: int
    freeable_bytes: int
    forward_s: float
    calls: int = 1
    parameter_bytes: int = 0
    checkpointed: bool = False
    cast_bytes: int = 0  # of the freeable bytes: autocast's parameter casts (its cache holds them in forward)
    recompute_s: float | None = None  # the forward up to its last saved tensor (None: forward_s)
    recompute_bytes: int = 0  # how far its recompute rises over the level it starts from
    forward_end: int = 0  # the timeline segment from which its freeable bytes are held
    backward_start: int = 0  # the segment its backward (and recompute) begins
    backward_start_bytes: int = 0  # the level when its backward begins
    # (segment, bytes): what its checkpoint frees only from that segment on (others saved it too)
    late_freeable: list[tuple[int, int]] = field(default_factory=list)
    # (segment, bytes, group): its inputs that the step let go before its backward; its checkpoint
    # keeps them from that segment through its backward's (group: the storage, shared by blocks)
    kept_inputs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """What checkpointing it adds to a step: its recompute."""
        return self.forward_s if self.recompute_s is None else self.recompute_s


@dataclass
class Measurement:
    device: str
    blocks: list[Block]
    peak_bytes: int
    peak_source: str
    activation_bytes: int
    unrecomputable_activation_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    temporary_bytes: int
    step_s: float
    typical_step_s: float | None = None
    peak_includes_gradients: bool = False  # schema 1 on the CPU: the peak counted every gradient
    notes: list[str] = field(default_factory=list)
    error: str = ""
    # per segment: (highest level with autocast off, highest level while autocast's cache is on)
    timeline: list[tuple[int, int]] = field(default_factory=list)
    untracked_bytes: int = 0  # the peak beyond the highest level seen after an operator
    drift_bytes: int = 0  # how far the levels fell short of the allocator's count between events
    drift_over_bytes: int = 0  # how far they went over it (already in the levels: not in the margin)
    preexisting_bytes: int = 0  # tensors alive at the step's start that Python held (not the model's)
    schema: int = SCHEMA

    def to_json(self, blocks: bool = True) -> dict[str, Any]:
        """The measurement as :func:`from_json` reads it (``blocks`` False: without its blocks
        and timeline, what the plan's text shows of it)."""
        return {
            "schema": self.schema,
            "device": self.device,
            "blocks": []
            if not blocks
            else [
                {
                    "name": b.name,
                    "class": b.cls,
                    "saved_bytes": b.saved_bytes,
                    "freeable_bytes": b.freeable_bytes,
                    "cast_bytes": b.cast_bytes,
                    "forward_s": b.forward_s,
                    "recompute_s": b.recompute_s,
                    "recompute_bytes": b.recompute_bytes,
                    "forward_end": b.forward_end,
                    "backward_start": b.backward_start,
                    "backward_start_bytes": b.backward_start_bytes,
                    "late_freeable": [list(x) for x in b.late_freeable],
                    "kept_inputs": [list(x) for x in b.kept_inputs],
                    "calls": b.calls,
                    "parameter_bytes": b.parameter_bytes,
                    "checkpointed": b.checkpointed,
                }
                for b in self.blocks
            ],
            "timeline": [list(t) for t in self.timeline] if blocks else [],
            "untracked_bytes": self.untracked_bytes,
            "drift_bytes": self.drift_bytes,
            "drift_over_bytes": self.drift_over_bytes,
            "preexisting_bytes": self.preexisting_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_source": self.peak_source,
            "activation_bytes": self.activation_bytes,
            "unrecomputable_activation_bytes": self.unrecomputable_activation_bytes,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "temporary_bytes": self.temporary_bytes,
            "step_s": self.step_s,
            "typical_step_s": self.typical_step_s,
            "peak_includes_gradients": self.peak_includes_gradients,
            "notes": list(self.notes),
            "error": self.error,
        }


def _int(doc: dict[str, Any], key: str, default: int | None = None) -> int:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_BYTES:
        raise ArtifactError(f"memory plan measurement: {key} is not a byte count: {str(v)[:40]!r}")
    return v


def _float(doc: dict[str, Any], key: str, default: float | None = None) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e7:
        raise ArtifactError(f"memory plan measurement: {key} is not a number of seconds: {str(v)[:40]!r}")
    return float(v)


def _str(doc: dict[str, Any], key: str, limit: int = 500) -> str:
    v = doc.get(key, "")
    if not isinstance(v, str):
        raise ArtifactError(f"memory plan measurement: {key} is not text")
    return v[:limit]


def _counts(values: list[Any]) -> bool:
    """Whether every one of ``values`` is a byte count (or a segment, or a group)."""
    for v in values:
        if type(v) is not int or not 0 <= v <= MAX_BYTES:
            return False
    return True


def from_json(doc: Any) -> Measurement:
    """The measurement in ``doc`` (from an agent, a file, a sidecar), checked and bounded.

    Schema 1 (dynprof before the timeline) is read too: its blocks' timeline is made up by the
    rule it was planned with (every block held at the peak, each recompute when the blocks
    after it are done with)."""
    if not isinstance(doc, dict):
        raise ArtifactError("memory plan measurement: not a JSON object")
    schema = doc.get("schema")
    if schema not in (1, SCHEMA) or isinstance(schema, bool):
        raise ArtifactError(
            f"memory plan measurement: schema {str(schema)[:20]!r}, this dynprof reads 1 and {SCHEMA}",
            help="Use the same dynprof version for the CLI and the job.",
        )
    raw_blocks = doc.get("blocks")
    if not isinstance(raw_blocks, list) or len(raw_blocks) > MAX_BLOCKS:
        raise ArtifactError(f"memory plan measurement: blocks is not a list of at most {MAX_BLOCKS}")
    raw_timeline = doc.get("timeline", []) if schema == SCHEMA else []
    if not isinstance(raw_timeline, list) or len(raw_timeline) > MAX_SEGMENTS:
        raise ArtifactError(f"memory plan measurement: timeline is not a list of at most {MAX_SEGMENTS}")
    timeline: list[tuple[int, int]] = []
    for seg in raw_timeline:
        if not (isinstance(seg, list) and len(seg) == 2 and _counts(seg)):
            raise ArtifactError("memory plan measurement: a timeline segment is not two byte counts")
        timeline.append((seg[0], seg[1]))
    segments = len(timeline)
    blocks = []
    entries = 0
    for b in raw_blocks:
        if not isinstance(b, dict):
            raise ArtifactError("memory plan measurement: a block is not an object")
        calls = b.get("calls", 1)
        if isinstance(calls, bool) or not isinstance(calls, int) or not 0 <= calls <= 1_000_000:
            raise ArtifactError("memory plan measurement: a block's calls is not a count")
        recompute = b.get("recompute_s")
        block = Block(
            name=_str(b, "name", 300),
            cls=_str(b, "class", 200),
            saved_bytes=_int(b, "saved_bytes"),
            freeable_bytes=_int(b, "freeable_bytes"),
            forward_s=_float(b, "forward_s"),
            calls=calls,
            parameter_bytes=_int(b, "parameter_bytes", 0),
            checkpointed=bool(b.get("checkpointed", False)),
        )
        if schema == SCHEMA:
            block.cast_bytes = min(_int(b, "cast_bytes", 0), block.freeable_bytes)
            block.recompute_s = None if recompute is None else _float(b, "recompute_s")
            block.recompute_bytes = _int(b, "recompute_bytes", 0)
            block.forward_end = min(_int(b, "forward_end"), segments)
            block.backward_start = min(_int(b, "backward_start"), segments)
            block.backward_start_bytes = _int(b, "backward_start_bytes", 0)
            late = b.get("late_freeable", [])
            if not isinstance(late, list) or len(late) > MAX_LATE:
                raise ArtifactError(f"memory plan measurement: late_freeable is not a list of at most {MAX_LATE}")
            kept = b.get("kept_inputs", [])
            if not isinstance(kept, list) or len(kept) > MAX_KEPT:
                raise ArtifactError(f"memory plan measurement: kept_inputs is not a list of at most {MAX_KEPT}")
            entries += len(late) + len(kept)
            if entries > MAX_ENTRIES:
                raise ArtifactError(
                    f"memory plan measurement: over {MAX_ENTRIES} late_freeable and kept_inputs entries in all"
                )
            for x in late:
                if not (isinstance(x, list) and len(x) == 2 and _counts(x)):
                    raise ArtifactError("memory plan measurement: a late_freeable entry is not a segment and bytes")
                block.late_freeable.append((min(x[0], segments), x[1]))
            for x in kept:
                if not (isinstance(x, list) and len(x) == 3 and _counts(x)):
                    raise ArtifactError(
                        "memory plan measurement: a kept_inputs entry is not a segment, bytes and a group"
                    )
                block.kept_inputs.append((min(x[0], segments), x[1], x[2]))
        blocks.append(block)
    notes = doc.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ArtifactError("memory plan measurement: notes is not a list of text")
    typical = doc.get("typical_step_s")
    m = Measurement(
        device=_str(doc, "device", 40),
        blocks=blocks,
        peak_bytes=_int(doc, "peak_bytes"),
        peak_source=_str(doc, "peak_source"),
        activation_bytes=_int(doc, "activation_bytes"),
        unrecomputable_activation_bytes=_int(doc, "unrecomputable_activation_bytes"),
        parameter_bytes=_int(doc, "parameter_bytes"),
        gradient_bytes=_int(doc, "gradient_bytes"),
        optimizer_state_bytes=_int(doc, "optimizer_state_bytes"),
        temporary_bytes=_int(doc, "temporary_bytes", 0),
        step_s=_float(doc, "step_s", 0.0),
        typical_step_s=None if typical is None else _float(doc, "typical_step_s"),
        peak_includes_gradients=doc.get("peak_includes_gradients") is True,
        notes=[n[:500] for n in notes[:50]],
        error=_str(doc, "error"),
        timeline=timeline,
        untracked_bytes=_int(doc, "untracked_bytes", 0) if schema == SCHEMA else 0,
        drift_bytes=_int(doc, "drift_bytes", 0) if schema == SCHEMA else 0,
        drift_over_bytes=_int(doc, "drift_over_bytes", 0) if schema == SCHEMA else 0,
        preexisting_bytes=_int(doc, "preexisting_bytes", 0) if schema == SCHEMA else 0,
        schema=schema,
    )
    if schema == 1:
        _legacy_timeline(m)
    return m


def _legacy_timeline(m: Measurement) -> None:
    """A schema-1 measurement's timeline, by the rule it was planned with: one segment at the
    peak with every block held; then backward, last block first, block k's recompute when the
    blocks after it are done with (their freeable bytes gone, their gradients there, unless the
    peak counted them) and the chosen before it still held."""
    n = len(m.blocks)
    m.timeline = [(m.peak_bytes, 0)] + [(0, 0)] * n
    for i, b in enumerate(m.blocks):
        after = m.blocks[i + 1 :]
        grads = 0 if m.peak_includes_gradients else sum(a.parameter_bytes for a in after)
        relief = sum(a.freeable_bytes for a in after) - grads
        b.forward_end = 0
        b.backward_start = n - i
        b.backward_start_bytes = max(0, m.peak_bytes - relief)
        b.recompute_bytes = b.freeable_bytes


# -- the predicted peak ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    blocks: tuple[int, ...]  # indices into the candidates, in forward order
    freed: int  # sum of the candidates' freeable bytes
    cost: float  # sum of their recompute seconds
    peak: int  # the predicted peak with them checkpointed (:func:`peak_with`)


@dataclass
class Candidates:
    """The blocks a plan may choose (not checkpointed already, freeing something), in forward
    order, with the timeline: what :func:`peak_with` and :func:`solve` work on."""

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


# -- the plan ----------------------------------------------------------------------------------
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


# The recipes' common part: the chosen modules of one model as the user's code holds it (DDP's
# ``module``, torch.compile's ``_orig_mod`` taken off), checked to exist: a name that matches
# nothing raises, never wraps nothing silently.
_CHOSEN = (
    "def chosen_modules(model):\n"
    "    # the model as your code built it: DDP's .module and torch.compile's ._orig_mod taken off\n"
    "    while type(model).__name__ in ('DistributedDataParallel', 'DataParallel', 'OptimizedModule'):\n"
    "        model = model._orig_mod if hasattr(model, '_orig_mod') else model.module\n"
    "    names = {names}\n"
    "    found = {{n: m for n, m in model.named_modules() if n in names}}\n"
    "    if set(found) != names:\n"
    "        raise RuntimeError(f'the memory plan names modules that {{type(model).__name__}} does not have: '\n"
    "                           f'{{sorted(names - set(found))}}')\n"
    "    return found\n"
)


def _models(modules: list[str]) -> dict[str, list[str]]:
    """The chosen modules by model: ``{"": names}`` for one model, else by each model's class
    name (``Class:path``: the plan cannot know the user's variable names for them)."""
    out: dict[str, list[str]] = {}
    for name in modules[:MAX_BLOCKS]:
        model, sep, path = name.partition(":")
        out.setdefault(model if sep else "", []).append(path if sep else name)
    return out


def _variable(cls: str) -> str:
    """A variable name for a model of class ``cls`` (``Discriminator`` -> ``discriminator``)."""
    out = "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(cls))
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in out).split("#")[0]
    return out if out and out.isidentifier() else "model"


def _recipe(modules: list[str], head: str, per_model: str) -> str:
    """``head``, the chosen-modules check, and ``per_model`` (which uses ``model``) run for each
    model the modules belong to."""
    by_model = _models(modules)
    if list(by_model) in ([""], []):
        names = "{" + ", ".join(repr(n) for n in by_model.get("", [])) + "}" if by_model else "set()"
        return head + "CHECKPOINT = " + names + "\n" + _CHOSEN.format(names="CHECKPOINT") + per_model
    table = ", ".join(f"{cls!r}: {{" + ", ".join(repr(n) for n in names) + "}" for cls, names in by_model.items())
    variables = ", ".join(_variable(cls.split("#")[0]) for cls in by_model)
    body = "\n".join("    " + line for line in per_model.rstrip("\n").splitlines())
    return (
        head
        + "# each model's modules under its class name (the plan cannot know your names for the models)\n"
        + f"CHECKPOINT = {{{table}}}\n"
        + _CHOSEN.format(names="CHECKPOINT[type(model).__name__]").replace(
            "    names = CHECKPOINT[type(model).__name__]", "    names = CHECKPOINT.get(type(model).__name__, set())"
        )
        + f"for model in ({variables},):  # your models\n"
        + body
        + "\n"
    )


def how_to_apply(m: Measurement, modules: list[str]) -> dict[str, str]:
    """How to checkpoint exactly ``modules`` in the usual frameworks. Each recipe names the
    modules as the user's code holds the model (unwrapped from DDP and torch.compile; with
    several models, each by its class name) and raises when a name matches nothing."""
    return {
        "torch.utils.checkpoint": _recipe(
            modules,
            "import torch.utils.checkpoint as cp\n",
            "for name, mod in chosen_modules(model).items():\n"
            "    fwd = mod.forward\n"
            "    mod.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)\n"
            "# (a Hugging Face model: train it with use_cache=False, or its KV cache keeps what each recompute makes)\n",
        ),
        "fsdp checkpoint_wrapper": _recipe(
            modules,
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
            "    apply_activation_checkpointing, checkpoint_wrapper)\n",
            "ids = {id(m) for m in chosen_modules(model).values()}\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            "                               check_fn=lambda m, ids=ids: id(m) in ids)\n",
        ),
        "hugging face": _recipe(
            modules,
            "# Enabling checkpointing checkpoints every layer. Where the layers are\n"
            "# GradientCheckpointingLayer (recent transformers), enable it, then turn it off\n"
            "# on the layers not chosen; elsewhere, leave it off and wrap the chosen layers as with\n"
            "# torch.utils.checkpoint above.\n",
            "keep = set(chosen_modules(model).values())\n"
            "if hasattr(model, 'activation_checkpointing_enable'):  # transformers 5.x\n"
            "    model.activation_checkpointing_enable({'use_reentrant': False})\n"
            "else:\n"
            "    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})\n"
            "for name, mod in model.named_modules():\n"
            "    layer = any(c.__name__ == 'GradientCheckpointingLayer' for c in type(mod).__mro__)\n"
            "    if layer and mod not in keep:\n"
            "        mod.gradient_checkpointing = False\n",
        ),
        "deepspeed": _recipe(
            modules,
            "# After deepspeed.initialize (or deepspeed.init_distributed); ds_config is your DeepSpeed\n"
            "# config (a dict or its path), whose activation_checkpointing section this reads, e.g.\n"
            '# "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false}.\n'
            "# DeepSpeed's checkpoint is reentrant: a Hugging Face model must train with use_cache=False\n"
            "# (its recompute would read the KV cache its forward filled: wrong gradients).\n"
            "import deepspeed\n"
            "deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)\n",
            "for name, mod in chosen_modules(model).items():\n"
            "    fwd = mod.forward\n"
            "    mod.forward = lambda *a, _f=fwd, **k: deepspeed.checkpointing.checkpoint(_f, *a, **k)\n",
        ),
    }


def plan_step(
    model: Any,
    optimizer: Any,
    step: Callable[[], Any],
    budget: int | None = None,
    save: int | None = None,
    reset_peak: bool = False,
) -> dict[str, Any]:
    """In-process: measure one ``step()`` and plan for ``budget`` (bytes) or ``save`` (bytes)."""
    from collectors.memory.plan_capture import measure_step

    return make_plan(from_json(measure_step(model, optimizer, step, reset_peak=reset_peak)), budget=budget, save=save)


def render_text(doc: dict[str, Any]) -> str:
    """The plan for a person. Every string of the measurement (its device, the peak's source,
    its notes, the blocks' names: from a process, a file, another node) is shown as one
    printable line (:func:`dynprof.safetext.one_line`): none forges a line of the plan."""
    from dynprof.safetext import one_line
    from dynprof.units import human_bytes as hb

    m = doc["measurement"]
    lines = [
        f"measured step on {one_line(m['device'], 40)}: peak {hb(m['peak_bytes'])} ({one_line(m['peak_source'], 200)})",
        f"  parameters {hb(m['parameter_bytes'])}, gradients {hb(m['gradient_bytes'])}, "
        f"optimizer state {hb(m['optimizer_state_bytes'])}, activations {hb(m['activation_bytes'])} "
        f"({hb(m['unrecomputable_activation_bytes'])} no block can free), temporaries {hb(m['temporary_bytes'])}",
        f"  {doc['candidates']} blocks can be checkpointed; measured step took {m['step_s']:.3f} s"
        + (f" (typical step {m['typical_step_s']:.3f} s)" if m.get("typical_step_s") else ""),
    ]
    for n in m.get("notes") or []:
        lines.append(f"  note: {one_line(n, 500)}")
    lines.append(f"budget {hb(doc['budget_bytes'])}: needs {hb(doc['need_bytes'])} off the peak")
    margin = doc.get("margin_bytes")
    if margin:
        drift = m.get("drift_bytes") or 0
        lines.append(
            f"  the plan aims {hb(margin)} under it: 1 % of the peak above parameters, gradients and optimizer state"
            + (f", and {hb(drift)} the measured levels fell short of the allocator's count" if drift else "")
        )
        over = m.get("drift_over_bytes") or 0
        if over:
            lines.append(
                f"  (the measured levels went up to {hb(over)} over the allocator's count: a storage died unseen; "
                "the predicted peak is that much on the safe side, not counted again in the margin)"
            )
    plan = doc.get("plan")
    if doc["status"] == "fits-already":
        lines.append("the step's peak is under the budget already: nothing to checkpoint")
    elif plan:
        frac = plan.get("added_step_fraction")
        lines.append(
            f"plan: checkpoint {len(plan['modules'])} module(s): "
            + ", ".join(one_line(name, 300) for name in plan["modules"][:12])
            + (" ..." if len(plan["modules"]) > 12 else "")
        )
        lines.append(
            f"  predicted peak {hb(plan['predicted_peak_bytes'])}, step time +{plan['added_step_s'] * 1000:.1f} ms"
            + (f" (+{frac * 100:.1f} %)" if frac is not None else "")
            + ": each block's forward again, up to its last saved tensor"
        )
        for r in doc.get("runners_up") or []:
            lines.append(
                f"  runner-up: {len(r['modules'])} module(s), peak {hb(r['predicted_peak_bytes'])}, "
                f"+{r['added_step_s'] * 1000:.1f} ms"
            )
        lines.append("how to apply (torch.utils.checkpoint):")
        lines.extend("  " + one_line(x, None) for x in doc["apply"]["torch.utils.checkpoint"].split("\n"))
        lines.append("  (--json has the same for FSDP's checkpoint_wrapper, Hugging Face and DeepSpeed)")
    else:
        lines.append(
            f"no set of blocks reaches the budget: the least any reaches (the floor) is {hb(doc['floor_bytes'])}"
        )
        for o in doc.get("beyond") or []:
            figure = o.get("saves_bytes", o.get("saves_bytes_with_8_ranks"))
            if figure is not None:
                lines.append(
                    f"  {o['option']}: saves {hb(figure)}" + (" with 8 ranks" if "saves_bytes" not in o else "")
                )
    if not doc.get("exact", True):
        slack = doc.get("slack_bytes") or 0
        lines.append(
            "  (not exact: the search reached its bound and merged alike states; the plan meets the rule, "
            + (f"no dearer than the cheapest for a budget {hb(slack)} lower)" if slack else "maybe not the cheapest)")
        )
    return "\n".join(lines)


KIND = "memory-plan"
PLAN_FILE = "plan.json"
MAX_PLAN_FILE_BYTES = 64 << 20


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary and text of a ``memory-plan`` artifact (``dynprof show``, the sidecar's page): the
    plan as ``dynprof memory plan`` printed it, re-derived from the measurement it saved (read
    with :func:`from_json`'s checks) for the budget or saving it was asked for; for one of
    ``dynprof run --checkpoint``, first what it applied and verified
    (:mod:`collectors.memory.plan_applied`, also the summary's ``checkpoint``)."""
    from collectors.memory import plan_applied

    doc = artifact.read_json(PLAN_FILE, MAX_PLAN_FILE_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("measurement"), dict):
        raise ArtifactError(f"{PLAN_FILE} holds no measurement")
    m = from_json(doc["measurement"])
    plan_applied.clean_measurement(m)  # the file's strings, one printable line each
    raw = doc.get("asked")
    asked: dict[str, Any] = raw if isinstance(raw, dict) else {}
    budget, save = asked.get("budget_bytes"), asked.get("save_bytes")
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        plan = make_plan(m, budget=budget, measurement=False)
    elif isinstance(save, int) and not isinstance(save, bool) and 0 <= save <= m.peak_bytes:
        plan = make_plan(m, save=save, measurement=False)
    elif isinstance(save, int) and not isinstance(save, bool) and save > m.peak_bytes:
        raise ArtifactError(f"{PLAN_FILE} asks to save {save} bytes, more than its measured peak ({m.peak_bytes})")
    else:
        raise ArtifactError(f"{PLAN_FILE} says neither the budget nor the saving that was asked for")
    chosen = plan.get("plan") or {}
    summary = {
        "status": plan["status"],
        "budget_bytes": plan["budget_bytes"],
        "modules": list(chosen.get("modules") or [])[:64],
        "predicted_peak_bytes": chosen.get("predicted_peak_bytes"),
        "measured_peak_bytes": m.peak_bytes,
    }
    text = render_text(plan)
    applied = plan_applied.read(doc.get("applied"))  # `dynprof run --checkpoint`: what it applied, verified
    if applied is not None:
        summary["checkpoint"] = applied
        text = "\n".join(plan_applied.lines(applied)) + "\n\nthe plan of the measured step, for this budget:\n" + text
    return summary, text
