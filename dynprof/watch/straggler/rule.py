"""The straggler rule of the watch: the figures of one sample's analysis in, the verdict out.

Pure: no I/O. :func:`straggler_verdict` reads the job's analysis
(:func:`collectors.trace_analysis.job.combine`, whose ``detect_straggler`` decides) and the
per-rank reductions behind it, and returns a score per (node, rank) and, when the rule names a
straggler, a ``straggler`` :class:`~dynprof.watch.model.Verdict` naming its rank, its node and
the cause class; :func:`judge` puts them in a :class:`StragglerReport`, the straggler signal's
:class:`~dynprof.watch.sampler.SignalReport` (the ``score`` gauge per rank, the verdict, its
``straggler_sample`` event and stderr line). The sample that takes the traces is
:mod:`dynprof.watch.straggler.sampler`.

The score of a rank is its work outside collectives per step in excess of the median of the
other ranks' work, as a fraction of the job's median step time (``excess_ms /
median step_ms``): 0.3 says the rank makes every step 30 % longer than it would be. It is given
to the straggler the rule names; every other rank scores 0 (so does every rank when the rule
names none: what is under the noise threshold is not a score).

The cause class is the analysis's own (:func:`collectors.trace_analysis.job.cause_of`): the
headline and the reason's detail come from that one computation, from what the straggler's trace
measures over its peers' mean: its own kernels' extra GPU time is ``GPU compute``; extra time in
kernel launches while it launches far more kernels than its peers is ``host launch`` (a launch
that takes longer for as many kernels waits for a full queue: waiting); extra GPU copying, or
extra time in copy calls while it copies more bytes, is ``host-to-device copy`` (a copy call
that takes longer for no more bytes waits for the kernels before it: waiting); extra time
outside operators is ``data loading`` or ``input pipeline``; the rest of its CPU operators'
extra time is ``CPU operators``. The per-category excess (``category_excess_ms``) and the
measures behind the class (``cause_ms``) are kept in the evidence.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectors.trace_analysis.job import CAUSE_CLASSES, short_function
from dynprof.watch.model import Culprit, RankValues, Verdict
from dynprof.watch.signals import STRAGGLER

_COLLECTIVE_NAMES = re.compile(
    r"c10d::|nccl|gloo:|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier|distributed_c10d", re.I
)
"""Names of collectives (ops, kernels, torch.distributed's own functions): where the others wait,
never what holds a straggler's extra time."""


@dataclass(slots=True)
class StragglerReport:
    """What one sampled job-wide trace said of stragglers (the watch's live straggler check): the
    straggler signal's :class:`~dynprof.watch.sampler.SignalReport`."""

    sampled_at: float
    steps: int  # steps traced
    scores: RankValues = field(default_factory=dict)  # (host, rank) -> score, 0: none
    verdict: Verdict | None = None  # kind "straggler" naming rank, host and cause class; None: none found
    note: str = ""  # why nothing was decided (one rank only, the trace failed, ...)
    cost_s: float = 0.0  # wall seconds the sample took (tracing, fetching, analysis)
    at_step: int | None = None  # the step every rank's trace started at; None: none was armed
    check: str = ""  # the straggler rule's own line (what it measured, its noise threshold)
    traces: list[str] = field(default_factory=list)  # trace artifacts it wrote in this machine's store (local samples)
    groups: list[str] = field(default_factory=list)  # its trace groups on the nodes (sidecar samples)

    @property
    def signal(self) -> str:
        return STRAGGLER.name

    def gauges(self) -> dict[str, RankValues]:
        return {STRAGGLER.gauges[0].name: self.scores}

    def to_json(self) -> dict[str, Any]:
        return report_json(self)

    def line(self) -> str:
        return sample_line(self)


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def category_excess(straggler_row: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, float]:
    """Per work category, the straggler's ms/step over the others' mean (rows of the analysis's
    ``ranks``): ``cpu.ops``, ``cpu.outside_ops``, and with GPU activities ``gpu.compute`` (with
    its overlapped part), ``gpu.memcpy``, ``gpu.idle``, ``gpu.comm``."""

    def cat(row: dict[str, Any], side: str, key: str) -> float:
        part = row.get(side)
        return _number(part.get(key)) if isinstance(part, dict) else 0.0

    out: dict[str, float] = {}
    keys: dict[str, Callable[[dict[str, Any]], float]]
    if isinstance(straggler_row.get("gpu"), dict):
        keys = {
            "gpu.compute": lambda r: cat(r, "gpu", "compute") + cat(r, "gpu", "comm_overlap"),
            "gpu.memcpy": lambda r: cat(r, "gpu", "memcpy"),
            "gpu.idle": lambda r: cat(r, "gpu", "idle"),
            "gpu.comm": lambda r: cat(r, "gpu", "comm"),
        }
    else:
        keys = {
            "cpu.ops": lambda r: cat(r, "cpu", "ops"),
            "cpu.outside_ops": lambda r: cat(r, "cpu", "outside_ops"),
        }
    for name, of in keys.items():
        out[name] = round(of(straggler_row) - _mean([of(o) for o in others]), 3)
    return out


def top_python_excess(mine: dict[str, Any], rest: list[dict[str, Any]], steps: int) -> tuple[str, float] | None:
    """The Python function (``with_stack`` traces) whose time outside operators per step grew
    most over the other ranks' mean, innermost of those within 5 % of the most."""
    table = mine.get("python_outside")
    if not isinstance(table, dict) or not table:
        return None
    excess: dict[str, float] = {}
    for name, v in table.items():
        theirs = _mean([_number((r.get("python_outside") or {}).get(name, [0.0])[0]) for r in rest])
        excess[name] = (_number(v[0]) - theirs) / max(1, steps)
    best = max(excess.values())
    if best <= 0:
        return None
    near = [n for n, v in excess.items() if v >= 0.95 * best]
    name = min(near, key=lambda n: _number(table[n][1]) / max(1.0, _number(table[n][2])))
    return short_function(name), excess[name]


# What a cause's extra time is in, in words, where the analysis names no function or kernel.
_CAUSE_WORDS = {
    "GPU compute": "GPU compute kernels",
    "host launch": "kernel launches",
    "host-to-device copy": "memory copies",
    "data loading": "data loading",
    "input pipeline": "outside operators (Python, data loading)",
    "CPU operators": "CPU operators",
}


def _named(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        for key in ("name", "function", "op", "kernel"):
            if isinstance(entry.get(key), str):
                return str(entry[key])
    return None


def what_holds(straggler: dict[str, Any], function: str | None) -> str | None:
    """What holds the straggler's extra time, as the analysis names it: the Python function
    whose time grew most (``function``), else the first of the analysis's ``top`` names (ops,
    kernels, functions) that is not a collective. None when neither names one."""
    candidates: list[str] = [function] if function else []
    top = straggler.get("top")
    if isinstance(top, (list, tuple)):
        candidates += [n for n in (_named(t) for t in top[:20]) if n]
    elif top is not None and _named(top):
        candidates.append(str(_named(top)))
    for name in candidates:
        if not _COLLECTIVE_NAMES.search(name):
            return name[:200]
    return None


def straggler_verdict(
    job: str, analysis: dict[str, Any], ranks: list[dict[str, Any]], sampled_at: float
) -> tuple[dict[tuple[str, int], float], Verdict | None, str]:
    """Scores per (node, rank), the ``straggler`` verdict when the rule of ``analyze`` names
    one (else None), and the rule's own line (its noise threshold)."""
    rows = [r for r in analysis.get("ranks") or [] if isinstance(r.get("rank"), int)]
    scores: dict[tuple[str, int], float] = {(str(r["host"]), int(r["rank"])): 0.0 for r in rows}
    check = str(analysis.get("straggler_check") or "")
    s = analysis.get("straggler")
    if not isinstance(s, dict) or not rows:
        return scores, None, check
    median_step = statistics.median([_number(r.get("step_ms_median")) for r in rows]) or 0.0
    excess_ms = _number(s.get("excess_ms"))
    score = round(excess_ms / median_step, 4) if median_step > 0 else 0.0
    host, rank = str(s.get("host")), s.get("rank")
    if isinstance(rank, int):
        scores[(host, rank)] = score
    mine = next((r for r in rows if r["rank"] == rank and str(r["host"]) == host), None)
    others = [r for r in rows if r is not mine]
    excess = category_excess(mine, others) if mine else {}
    reduced = next((r for r in ranks if r.get("rank") == rank and str(r.get("host")) == host), None)
    rest = [r for r in ranks if r is not reduced]
    steps = len(analysis.get("common_steps") or []) or 1
    named = top_python_excess(reduced, rest, steps) if reduced else None
    function = named[0] if named else None
    # one computation: the analysis's class, the same that words its reason
    cause = s["cause"] if s.get("cause") in CAUSE_CLASSES else "unknown"
    holds = what_holds(s, function) if cause in ("data loading", "input pipeline", "CPU operators") else None
    where = holds or _CAUSE_WORDS.get(cause, cause)
    node_host = mine.get("node_host") if mine else None
    on = f"{host}" + (f" ({node_host})" if node_host and node_host != host else "")
    conclusion = (
        f"rank {rank} on {on} is a straggler ({cause}): it works {excess_ms:.1f} ms/step more than the "
        f"others' median, {score * 100:.0f} % of the {median_step:.1f} ms step (score {score:.2f}); "
        f"its extra time is in {where}; {s.get('reason')}"
    )
    culprit = Culprit(
        rank=rank if isinstance(rank, int) else None,
        host=host,
        where=where,
        why=f"{cause}: {excess_ms:.1f} ms/step of work over the others",
        since_step=(analysis.get("common_steps") or [None])[0],
    )
    verdict = Verdict(
        kind="straggler",
        job=job,
        conclusion=conclusion,
        detected_at=sampled_at,
        decided_at=time.time(),
        culprits=[culprit],
        ranks=[
            {
                "rank": r["rank"],
                "host": str(r["host"]),
                "node_host": r.get("node_host"),
                "step_ms": r.get("step_ms"),
                "work_ms": r.get("work_ms"),
                "collective_ms": r.get("collective_ms"),
                "score": scores.get((str(r["host"]), int(r["rank"])), 0.0),
                "state": "straggler" if r is mine else "waits in collectives",
            }
            for r in rows
        ],
        evidence={
            "straggler": {
                **s,
                "cause": cause,
                "holds": where,
                "score": score,
                "score_rule": "excess work over the others' median, as a fraction of the median step time",
                "category_excess_ms": excess,
                "function": function,
                "check": check,
            },
            "samples": {"steps": analysis.get("common_steps") or [], "ranks": len(rows)},
        },
    )
    return scores, verdict, check


def judge(
    report: StragglerReport,
    job: str,
    analysis: dict[str, Any],
    reduced: list[dict[str, Any]],
    notes: list[str],
    steps: int,
) -> None:
    """The straggler rule over a sample's analysis, into ``report`` (scores, verdict, notes)."""
    if len(analysis["ranks"]) < 2:
        report.note = "; ".join(["fewer than 2 ranks analysed: no straggler check", *notes])[:2000]
        return
    report.steps = len(analysis.get("common_steps") or []) or steps
    report.scores, report.verdict, check = straggler_verdict(job, analysis, reduced, report.sampled_at)
    report.check = check[:2000]
    if report.verdict is not None:
        report.verdict.evidence["samples"]["at_step"] = report.at_step
    report.note = "; ".join([check, *notes])[:2000]


def report_json(report: StragglerReport) -> dict[str, Any]:
    """A report as JSON (for ``--json`` and the benchmarks): scores as rows."""
    return {
        "sampled_at": report.sampled_at,
        "steps": report.steps,
        "scores": [{"host": h, "rank": r, "score": s} for (h, r), s in sorted(report.scores.items())],
        "verdict": report.verdict.to_json() if report.verdict else None,
        "note": report.note,
        "cost_s": report.cost_s,
        "at_step": report.at_step,
        "check": report.check,
        "traces": report.traces,
    }


def sample_line(report: StragglerReport) -> str:
    """One line for people on what a sample found: ``straggler sample at step 1168: none (...)``,
    the straggler it names, or why it found nothing."""
    at = f" at step {report.at_step}" if report.at_step is not None else ""
    v = report.verdict
    if v is not None and v.culprits:
        c = v.culprits[0]
        found = v.evidence.get("straggler")
        s: dict[str, Any] = found if isinstance(found, dict) else {}
        score = _number(s.get("score"))
        return (
            f"straggler sample{at}: rank {c.rank} on {c.host} ({s.get('cause') or '?'}, score {score:.2f}): "
            f"{c.why}; its time in {c.where}"
        )
    if report.check:
        check = report.check.removeprefix("no straggler: ")
        return f"straggler sample{at}: none ({check})"
    return f"straggler sample{at}: nothing decided ({report.note or 'no reason given'})"
