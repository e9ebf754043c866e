"""The memory plan's measurement: one measured step (:mod:`.capture` writes it in the training
process) as the plan reads it, and :func:`from_json`, its one decoder.

The decoder is bounded (the document comes from a process, a file, another node): it reads the
first schema too (no timeline: the rule it was planned with is rebuilt from it,
:func:`_legacy_timeline`). This module needs no torch.
"""

from __future__ import annotations

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
MAX_BYTES = 1 << 60


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
    timed_steps: int = 0  # plain steps whose median timed the blocks' forward (0: the measured step)
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
            "timed_steps": self.timed_steps,
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
        timed_steps=min(_int(doc, "timed_steps", 0), 1000),
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
