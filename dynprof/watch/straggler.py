"""The watch's live straggler check: one aligned job-wide trace of a couple of steps, analysed
with the straggler rule of ``dynprof analyze``.

:func:`sample_stragglers` goes the way ``dynprof start --job J --hosts ... --steps N --fetch
DIR`` and then ``dynprof analyze`` go, through the same public functions: every node armed at
one common step (:func:`dynprof.job.start.arm_at_one_step`), each rank's trace followed until
written (:func:`dynprof.job.start.follow_traces`), the traces copied back and checked against
their manifests (:func:`dynprof.job.fetch.fetch_by_path`), then each rank's trace reduced and
the job's analysis combined (:func:`collectors.trace_analysis.rank.analyze_ranks`,
:func:`collectors.trace_analysis.job.combine`, whose ``detect_straggler`` decides). It returns a
:class:`StragglerReport`: a score per (node, rank) and, when the rule names a straggler, a
``straggler`` :class:`~dynprof.watch.model.Verdict` naming its rank, its node and the cause
class.

It is the watch's first sampled signal (its row is :data:`dynprof.watch.signals.STRAGGLER`):
:func:`sampler_for` is its :class:`~dynprof.watch.sampler.Sampler` for the watch's source, and
a :class:`StragglerReport` its :class:`~dynprof.watch.sampler.SignalReport` (the ``score``
gauge per rank, the verdict, its ``straggler_sample`` event and stderr line).

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

A sample is bounded (``limit_s``) and never raises: a trace that fails, a node that does not
answer, an analysis that finds nothing, each is a note in the report.
"""

from __future__ import annotations

import logging
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof import store, untrusted
from dynprof.errors import DynprofError
from dynprof.job.answers import node_labels
from dynprof.job.client import SidecarClient
from dynprof.job.fetch import fetch_by_path
from dynprof.job.start import PS_TIMEOUT_S, START_ARM_TIMEOUT_S, arm_at_one_step, follow_traces
from dynprof.nodes import Node, parse_node
from dynprof.watch.model import Culprit, RankValues, Verdict
from dynprof.watch.signals import STRAGGLER
from dynprof.watch.sources import SidecarSource

log = logging.getLogger("dynprof.watch.straggler")

SAMPLE_STEPS = 2
SAMPLE_LIMIT_S = 120.0
"""How long one sample may take in all (arming, tracing, fetching, analysis)."""
SAMPLE_EVERY_S = STRAGGLER.every_s
"""The default interval between samples (``--sample-every``): one sample costs the ranks about
half a second to a second of training (scripts/bench_watch_sampling.py measures it), so one
every ten minutes is under 0.2 % of the job's time, inside the 0.5 % budget."""
MAX_TRACE_DURATION_S = 300.0
"""The hard cap each agent puts on a sampled trace: it ends by itself past it."""
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


HookType = Callable[[str], StragglerReport | None]
"""``hook(job)``: one sampled straggler check of the job, on the nodes it was made for."""


class _Quiet:
    """Progress that says nothing: the watch prints its own lines."""

    def update(self, text: str) -> None:
        pass

    def done(self) -> None:
        pass


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
    from collectors.trace_analysis.job import short_function

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


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        doc = untrusted.loads_json(
            untrusted.read_bytes_in(str(path), store.MANIFEST, untrusted.MANIFEST_MAX_BYTES).decode("utf-8"),
            str(path / store.MANIFEST),
        )
    except (DynprofError, OSError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def analyse_fetched(
    fetched: list[dict[str, Any]], label_of: dict[str, str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job's analysis (``collectors.trace_analysis.job.combine``) of fetched trace artifacts
    (rows of :func:`dynprof.job.fetch.fetch`), each rank named by its node as the watch names
    it (``label_of``: node address -> name); and the per-rank reductions behind it."""
    from collectors.torch_trace import TRACE_FILE
    from collectors.trace_analysis.job import combine
    from collectors.trace_analysis.rank import RankInput, analyze_ranks, device_of

    items = []
    node_host: dict[tuple[str, Any], Any] = {}
    for row in fetched:
        if row.get("error") or not row.get("path"):
            continue
        path = Path(row["path"])
        manifest = _read_manifest(path)
        if manifest is None or not (path / TRACE_FILE).is_file():
            continue
        rank = manifest.get("rank") if isinstance(manifest.get("rank"), int) else None
        host = label_of.get(str(row.get("node")), str(row.get("node")))
        node_host[(host, rank)] = manifest.get("host")
        items.append(
            RankInput(
                path=str(path / TRACE_FILE),
                rank=rank,
                host=host,
                artifact=str(row.get("id")),
                device=device_of(manifest),
            )
        )
    ranks = analyze_ranks(items, workers=1)
    analysis = combine(ranks, top=10)
    for r in analysis["ranks"]:
        r["node_host"] = node_host.get((r["host"], r["rank"]))
    return analysis, [r for r in ranks if "error" not in r]


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
    from collectors.trace_analysis.job import CAUSE_CLASSES

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


def sample_stragglers(
    nodes: Sequence[Node | str],
    job: str,
    client: SidecarClient,
    *,
    steps: int = SAMPLE_STEPS,
    limit_s: float = SAMPLE_LIMIT_S,
    with_stack: bool = True,
    keep: Path | None = None,
    keep_groups: Sequence[str] = (),
) -> StragglerReport:
    """One sampled trace of ``steps`` steps of every rank of ``job`` on ``nodes``, analysed for
    a straggler. Never raises: what went wrong is the report's ``note``. ``keep``: copy the
    traces there and leave them (default: a temporary directory, removed).

    On each node the traces are a sample's (``dynprof start --sample-keep``): the node deletes
    its older samples' traces but the latest :data:`KEEP_SAMPLES` and ``keep_groups`` (those
    of samples that named a straggler); the report's ``groups`` are this sample's.

    ``nodes`` are the sidecars the user named: :class:`~dynprof.nodes.Node` objects (the
    watch's own), or full addresses ``HOST[:PORT]`` as the user wrote them. Never a display
    label: ``host`` alone stands for ``host:8787``, and the token would go there. Ranks and
    culprits are named by :func:`~dynprof.job.answers.node_labels` of these nodes (the names
    the watch prints)."""
    started = time.monotonic()
    sampled_at = time.time()
    report = StragglerReport(sampled_at=sampled_at, steps=steps)
    tmp: str | None = None
    try:
        parsed: list[Node] = []
        for given_node in nodes:
            node = given_node if isinstance(given_node, Node) else parse_node(given_node)
            if node not in parsed:
                parsed.append(node)
        if not parsed:
            report.note = "no node to sample"
            return report
        labels = node_labels(parsed)
        given = {n.address: labels[n] for n in parsed}
        ps_options = {"job": job, "timeout": PS_TIMEOUT_S}
        start_options: dict[str, Any] = {
            "job": job,
            "steps": steps,
            "no_wait": True,
            "timeout": START_ARM_TIMEOUT_S,
            "max_duration": min(MAX_TRACE_DURATION_S, max(10.0, limit_s)),
            "sample_keep": KEEP_SAMPLES,
        }
        if keep_groups:
            start_options["keep_groups"] = list(keep_groups)[-64:]
        if with_stack:
            start_options["with_stack"] = True
        armed = arm_at_one_step(
            client,
            parsed,
            labels,
            at_step=None,
            job=job,
            select_all=False,
            start_options=start_options,
            ps_options=ps_options,
            progress=_Quiet(),
        )
        report.at_step = armed.at_step
        report.groups = sorted(
            {
                str(a.result["group_id"])
                for a in armed.answers
                if a.ok and isinstance(a.result, dict) and isinstance(a.result.get("group_id"), str)
            }
        )[:256]
        if armed.at_step is None:
            report.note = "; ".join(armed.messages) or "no rank of the job has stepped"
            return report
        left = max(5.0, limit_s - (time.monotonic() - started))
        results, missed = follow_traces(
            client,
            parsed,
            labels,
            armed,
            ps_options=ps_options,
            no_wait=False,
            timeout=left,
            node_timeout=client.timeout,
            progress=_Quiet(),
        )
        address = {labels[n]: n.address for n in parsed}
        by_node: dict[str, list[str]] = {}
        for r in results:
            if r.get("status") in ("complete", "partial") and isinstance(r.get("artifact"), str) and r["artifact"]:
                by_node.setdefault(address[r["node"]], []).append(r["artifact"])
        if not by_node:
            why = "; ".join(f"rank {m['rank']} on {m['node']}: {m['reason']}" for m in missed[:5])
            report.note = f"no trace was written{': ' + why if why else ''}"
            return report
        dest = keep or Path(tmp := tempfile.mkdtemp(prefix="dynprof-straggler-"))
        fetched = fetch_by_path(client, dest, armed.answers, by_node, job)
        label_of = {n.address: given[n.address] for n in parsed}
        analysis, reduced = analyse_fetched(fetched, label_of)
        notes = [
            f"rank {m['rank']} on {given.get(address.get(m['node'], ''), m['node'])}: {m['reason']}" for m in missed
        ]
        notes += [f"not fetched from {f['node']}: {f['error']}" for f in fetched if f.get("error")]
        notes += [f"rank {e.get('rank')} not analysed: {e.get('error')}" for e in analysis.get("errors") or []]
        _judge(report, job, analysis, reduced, notes, steps)
        if report.verdict is not None:
            report.verdict.evidence["samples"]["missed"] = missed[:64]
        return report
    except Exception as exc:  # a sample that fails is a note, never the watch's end
        log.debug("straggler sample of %s failed", job, exc_info=exc)
        message = exc.message if isinstance(exc, DynprofError) else f"{type(exc).__name__}: {exc}"
        report.note = f"the sampled trace failed: {message}"[:2000]
        return report
    finally:
        report.cost_s = round(time.monotonic() - started, 3)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _judge(
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


KEEP_SAMPLES = 3
"""The sampled traces a watch leaves in the store it traces into: those of its latest
``KEEP_SAMPLES`` samples, and those of every sample that named a straggler (its verdict lists
them); the others' are deleted once they are older than that."""


class SampleTraces:
    """The trace artifacts a watch's samples wrote in one store, pruned after each sample (see
    :data:`KEEP_SAMPLES`). Only artifacts this watch's samples wrote are ever deleted."""

    def __init__(self, in_store: store.ArtifactStore | None = None, keep: int = KEEP_SAMPLES) -> None:
        self.store = in_store
        self.keep = max(1, keep)
        self._recent: list[tuple[list[str], bool]] = []  # (artifact paths, named a straggler), oldest first

    def add(self, paths: Sequence[str], named: bool) -> list[str]:
        """One sample's traces; returns the paths deleted."""
        self._recent.append((list(paths), named))
        removed: list[str] = []
        older, self._recent = self._recent[: -self.keep], self._recent[-self.keep :]
        where = self.store or store.ArtifactStore()
        for old_paths, old_named in older:
            if old_named:
                continue  # kept, and no longer followed
            for path in old_paths:
                try:
                    if where.remove(Path(path)):
                        removed.append(path)
                except (DynprofError, OSError) as exc:  # what cannot be deleted stays; the watch goes on
                    log.warning("dynprof watch: a sampled trace could not be deleted: %s", exc)
        return removed


LocalTrace = Callable[[str, int, float], dict[str, Any]]
"""``trace(job, steps, limit_s)``: one aligned trace of ``steps`` steps of this node's ranks of
``job`` (``dynprof start --job J --steps N --with-stack``), waited for; its ``--json`` document:
``{"group_id", "results": [{"pid", "rank", "start_step", "status", "artifact", "error"}]}``."""


def sample_local_stragglers(
    job: str,
    host: str,
    trace: LocalTrace,
    *,
    steps: int = SAMPLE_STEPS,
    limit_s: float = SAMPLE_LIMIT_S,
    traces: SampleTraces | None = None,
) -> StragglerReport:
    """One sampled trace of this node's ranks of ``job`` (read from their agents directly, no
    sidecar), analysed for a straggler with the same rule as :func:`sample_stragglers`; ranks are
    named on ``host``. Never raises. ``traces``: the sample's trace artifacts are handed to it
    (kept or pruned there); without it they stay in the store."""
    started = time.monotonic()
    report = StragglerReport(sampled_at=time.time(), steps=steps)
    written: list[str] = []
    try:
        doc = trace(job, steps, limit_s)
        results = [r for r in (doc.get("results") if isinstance(doc, dict) else None) or [] if isinstance(r, dict)]
        starts = [r["start_step"] for r in results if isinstance(r.get("start_step"), int) and r["start_step"] > 0]
        report.at_step = min(starts) if starts else None
        group = doc.get("group_id") if isinstance(doc, dict) else None
        notes: list[str] = []
        for r in results[:4096]:
            path = r.get("artifact")
            who = f"rank {r.get('rank')} (pid {r.get('pid')})"
            if not (r.get("status") in ("complete", "partial") and isinstance(path, str) and path):
                notes.append(f"{who}: {str(r.get('error') or 'no trace')[:300]}")
            elif not _sample_trace(path, group):  # an agent's answer names it: only this sample's traces count
                notes.append(f"{who}: {path[:300]!r} is not a trace of this sample in the store")
            else:
                written.append(path)
        if not written:
            report.note = ("no trace was written" + (": " + "; ".join(notes[:5]) if notes else ""))[:2000]
            return report
        report.traces = written[:64]
        fetched = [{"path": path, "node": host, "id": Path(path).name} for path in written]
        analysis, reduced = analyse_fetched(fetched, {host: host})
        notes += [f"rank {e.get('rank')} not analysed: {e.get('error')}" for e in analysis.get("errors") or []]
        _judge(report, job, analysis, reduced, notes, steps)
        if report.verdict is not None:
            report.verdict.evidence["samples"]["traces"] = written[:64]
        return report
    except Exception as exc:  # a sample that fails is a note, never the watch's end
        log.debug("straggler sample of %s failed", job, exc_info=exc)
        message = exc.message if isinstance(exc, DynprofError) else f"{type(exc).__name__}: {exc}"
        report.note = f"the sampled trace failed: {message}"[:2000]
        return report
    finally:
        report.cost_s = round(time.monotonic() - started, 3)
        if traces is not None and written:
            traces.add(written, report.verdict is not None)


def _sample_trace(path: str, group: Any) -> bool:
    """Whether ``path`` is a finished ``trace`` artifact of this machine's store written for the
    sample's request (its ``group_id``)."""
    if not isinstance(group, str) or not group:
        return False
    try:
        art = store.ArtifactStore().get(path)
    except (DynprofError, OSError):
        return False
    options = art.manifest.get("options")
    return (
        art.root is not None and art.kind == "trace" and isinstance(options, dict) and options.get("group_id") == group
    )


def local_straggler_hook(
    host: str, trace: LocalTrace, *, steps: int = SAMPLE_STEPS, limit_s: float = SAMPLE_LIMIT_S
) -> HookType:
    """The watch engine's straggler hook over this node's agents (``dynprof watch`` without
    node options): ``hook(job)`` takes one sample through ``trace``; the samples' traces are kept
    and pruned in this machine's store as :data:`KEEP_SAMPLES` says."""
    traces = SampleTraces()

    def hook(job: str) -> StragglerReport | None:
        return sample_local_stragglers(job, host, trace, steps=steps, limit_s=limit_s, traces=traces)

    return hook


def straggler_hook(
    client: SidecarClient,
    nodes: Sequence[Node],
    *,
    steps: int = SAMPLE_STEPS,
    limit_s: float = SAMPLE_LIMIT_S,
    with_stack: bool = True,
) -> HookType:
    """The watch engine's straggler hook: ``hook(job)`` takes one sample of the job on ``nodes``,
    the very node objects the watch reads progress from (never their display labels)."""
    chosen = list(nodes)
    named: list[str] = []  # the sample groups (every node's) of samples that named a straggler

    def hook(job: str) -> StragglerReport | None:
        report = sample_stragglers(
            chosen, job, client, steps=steps, limit_s=limit_s, with_stack=with_stack, keep_groups=named[-64:]
        )
        if report.verdict is not None:
            named.extend(g for g in report.groups if g not in named)
        return report

    return hook


class StragglerSampler:
    """The straggler signal as the watch's engine runs it
    (:class:`~dynprof.watch.sampler.Sampler`): every ``every_s``, ``hook(job)`` (one sample, of
    :func:`straggler_hook` or :func:`local_straggler_hook`); a hook that raises is said as a
    sample that failed."""

    name = STRAGGLER.name

    def __init__(self, hook: HookType, every_s: float | None, clock: Callable[[], float] = time.time) -> None:
        self.hook = hook
        self.every_s = every_s
        self.clock = clock

    def sample(self, job: str) -> StragglerReport | None:
        try:
            return self.hook(job)
        except Exception as exc:  # a failed sample is said, the watch goes on
            log.warning("dynprof watch: the straggler sample failed: %s", exc)
            return StragglerReport(sampled_at=self.clock(), steps=0, note=f"the sample failed: {exc}"[:2000])


def local_trace(job: str, steps: int, limit_s: float) -> dict[str, Any]:
    """A :data:`LocalTrace` of this node's agents: a trace of ``steps`` steps with stacks on them
    (the trace kind's own start, as ``dynprof start --job J --steps N --with-stack`` runs it),
    written in this machine's store, waited for."""
    from collectors.torch_trace.collect import TraceRequest, collect

    cap = min(MAX_TRACE_DURATION_S, max(10.0, limit_s))
    request = TraceRequest(job=job, steps=steps, with_stack=True, max_duration=cap, timeout=limit_s)
    return collect(request).doc


def sampler_for(source: Any, every_s: float | None) -> StragglerSampler:
    """The straggler's sampler for a watch's source (the factory of its row in
    :data:`~dynprof.watch.signals.SIGNALS`): over a :class:`~dynprof.watch.sources.SidecarSource`,
    through the same node objects, client and token that read the progress, so a sample goes to
    exactly the addresses the user named; else over this node's agents (``source.host`` names
    its ranks), its traces analysed in this machine's store."""
    if isinstance(source, SidecarSource):
        return StragglerSampler(straggler_hook(source.client, source.node_list), every_s)
    return StragglerSampler(local_straggler_hook(source.host, local_trace), every_s)


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
