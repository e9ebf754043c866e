"""One memory plan for a job's identical ranks, with each rank's figures.

The ranks of a data-parallel job (DDP, or FSDP with the same shards) run the same model on
inputs of the same shapes: their measured steps hold the same blocks and, to the allocator's
rounding, the same bytes; only their times differ (one rank waits for the others in an
all-reduce, another holds a slower GPU). Planned one by one, equal ranks got plans that differed
in which of several equal blocks they took, and no answer for the job. Here:

- :func:`differences` says how one rank's measurement differs from another's: blocks (names,
  classes, order), the first block input's shape, and each byte figure (the peak, parameters,
  gradients, optimizer state, activations, each block's saved and freeable bytes) beyond
  :data:`TOLERANCE` of the larger; times are not compared. No difference: the ranks agree.
- :func:`group` puts each job's ranks in groups that agree with the group's first rank (in
  rank order): a job of identical ranks is one group; a rank that differs starts its own, and
  the group says from which ranks it differs and how.
- :func:`merged` is the measurement a group is planned from: the bytes of its rank with the
  highest peak (the plan must fit every rank) and, for each block and the step, the slowest
  rank's time (the step waits for it).
- :func:`rank_figures` is each rank's own: its measured peak and step time, and the peak and
  recompute time the group's plan predicts on its own measurement.

The CLI (:func:`collectors.memory.collect.collect_plan`) plans each group once; the text and
``--json`` list every rank's figures under the one plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from collectors.memory.plan.measurement import Measurement, from_json
from collectors.memory.plan.predict import predict
from collectors.memory.plan.scale import input_shape
from dynprof.units import human_bytes

TOLERANCE = 0.05  # of the larger of two byte figures: within it, two ranks' figures agree
MAX_SAID = 4  # differences said per rank (the first found, in the order of the figures)
# The step's figures compared between ranks, in the order they are said.
FIGURES = (
    ("peak_bytes", "peak"),
    ("parameter_bytes", "parameters"),
    ("gradient_bytes", "gradients"),
    ("optimizer_state_bytes", "optimizer state"),
    ("activation_bytes", "activations"),
    ("unrecomputable_activation_bytes", "activations no block can free"),
)


def _agree(a: int, b: int, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(a, b)


def _against(name: str, a: int, b: int) -> str:
    """``peak 12.0 MiB against 10.0 MiB (+20 %)``: ``b`` against the reference ``a``."""
    pct = f" ({(b - a) / a * 100:+.0f} %)" if a else ""
    return f"{name} {human_bytes(b)} against {human_bytes(a)}{pct}"


def differences(
    a: Measurement,
    b: Measurement,
    shape_a: list[int] | None = None,
    shape_b: list[int] | None = None,
    tolerance: float = TOLERANCE,
) -> list[str]:
    """How ``b`` differs from ``a`` (at most :data:`MAX_SAID` of it, each said of ``b``
    against ``a``); ``[]``: they agree. ``shape_a``/``shape_b``: their first block input's
    shape (:func:`collectors.memory.plan.scale.input_shape`; not compared when unknown)."""
    out: list[str] = []
    if a.device.split(":")[0] != b.device.split(":")[0]:
        out.append(f"device {b.device} against {a.device}")
    names_a = [(x.name, x.cls) for x in a.blocks]
    names_b = [(x.name, x.cls) for x in b.blocks]
    if names_a != names_b:
        if len(names_a) != len(names_b):
            out.append(f"{len(names_b)} blocks against {len(names_a)}")
        else:
            i = next(i for i, (x, y) in enumerate(zip(names_a, names_b)) if x != y)
            out.append(f"block {i} is {names_b[i][0]} ({names_b[i][1]}) against {names_a[i][0]} ({names_a[i][1]})")
    if shape_a and shape_b and shape_a != shape_b:
        out.append(f"first block input {list(shape_b)} against {list(shape_a)}")
    for key, name in FIGURES:
        x, y = int(getattr(a, key)), int(getattr(b, key))
        if not _agree(x, y, tolerance):
            out.append(_against(name, x, y))
    if names_a == names_b:
        for p, q in zip(a.blocks, b.blocks):
            for key in ("saved_bytes", "freeable_bytes"):
                u, v = int(getattr(p, key)), int(getattr(q, key))
                if not _agree(u, v, tolerance):
                    out.append(_against(f"{p.name}'s {key.replace('_bytes', '')} bytes", u, v))
                    break
            if len(out) >= MAX_SAID:
                break
    return out[:MAX_SAID]


@dataclass
class Member:
    """One rank's measurement: its row's ``rank``, ``pid`` and the measurement's document."""

    rank: int | None
    pid: int
    doc: dict[str, Any]
    measurement: Measurement


@dataclass
class Group:
    """Ranks of one job whose measurements agree with the first's; ``differs_from`` and
    ``how``: for a group after the job's first, the ranks of the first group and how this
    group's first rank differs from them."""

    job: str | None
    members: list[Member]
    differs_from: list[int | None] = field(default_factory=list)
    how: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int | None]:
        return [m.rank for m in self.members]


def group(job: str | None, members: list[Member], tolerance: float = TOLERANCE) -> list[Group]:
    """``members`` (one job's ranks) in groups that agree, in rank order: each rank joins the
    first group whose first rank it agrees with, else starts a group that says how it differs
    from the job's first group."""

    def key(m: Member) -> tuple[int, int]:
        return (m.rank if m.rank is not None else 1 << 62, m.pid)

    groups: list[Group] = []
    for m in sorted(members, key=key):
        shape = input_shape(m.doc)
        for g in groups:
            first = g.members[0]
            if not differences(first.measurement, m.measurement, input_shape(first.doc), shape, tolerance):
                g.members.append(m)
                break
        else:
            new = Group(job, [m])
            if groups:
                first = groups[0].members[0]
                new.how = differences(first.measurement, m.measurement, input_shape(first.doc), shape, tolerance)
            groups.append(new)
    for g in groups[1:]:
        g.differs_from = groups[0].ranks  # the first group is complete now
    return groups


def merged(g: Group) -> tuple[dict[str, Any], Member, Member]:
    """The measurement ``g`` is planned from (a new document), the member whose bytes it
    holds and the member whose step time it takes: the bytes of the member with the highest peak, each block's and the step's times of
    the slowest member (by its typical step, else its measured step)."""
    highest = max(g.members, key=lambda m: m.measurement.peak_bytes)

    def step_of(m: Member) -> float:
        return m.measurement.typical_step_s or m.measurement.step_s

    slowest = max(g.members, key=step_of)
    doc = copy.deepcopy(highest.doc)
    blocks = doc.get("blocks") or []
    for i, raw in enumerate(blocks):
        if not isinstance(raw, dict):
            continue
        times = [m.measurement.blocks[i] for m in g.members if i < len(m.measurement.blocks)]
        raw["forward_s"] = max(t.forward_s for t in times)
        if raw.get("recompute_s") is not None:
            raw["recompute_s"] = max(t.seconds for t in times)
    doc["step_s"] = max(m.measurement.step_s for m in g.members)
    typical = [m.measurement.typical_step_s for m in g.members if m.measurement.typical_step_s]
    if typical:
        doc["typical_step_s"] = max(typical)
    return doc, highest, slowest


def rank_figures(g: Group, modules: list[str]) -> list[dict[str, Any]]:
    """Each member's own figures: its measured peak and step, and what the group's plan
    (``modules`` checkpointed) predicts on its own measurement."""
    out = []
    for m in g.members:
        p = predict(m.measurement, set(modules))
        out.append(
            {
                "rank": m.rank,
                "pid": m.pid,
                "peak_bytes": m.measurement.peak_bytes,
                "step_s": m.measurement.step_s,
                "typical_step_s": m.measurement.typical_step_s,
                "predicted_peak_bytes": p["predicted_peak_bytes"],
                "added_step_s": p["added_step_s"],
            }
        )
    return out


def member(row: dict[str, Any], doc: dict[str, Any]) -> Member:
    """A row of ``collect_plan`` (its rank and pid) with its measurement's document."""
    rank = row.get("rank")
    return Member(rank if isinstance(rank, int) else None, int(row["pid"]), doc, from_json(doc))


def ranks_text(ranks: list[int | None]) -> str:
    """``ranks 0-3, 5`` / ``rank 2``: ranks in runs."""
    known = sorted(r for r in ranks if r is not None)
    runs: list[str] = []
    i = 0
    while i < len(known):
        j = i
        while j + 1 < len(known) and known[j + 1] == known[j] + 1:
            j += 1
        runs.append(str(known[i]) if i == j else f"{known[i]}-{known[j]}")
        i = j + 1
    if len(known) < len(ranks):
        runs.append("-")
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)
