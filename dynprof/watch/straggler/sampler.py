"""The straggler signal's one sampler: one aligned job-wide trace of a couple of steps, taken by
the watch's source, analysed with the straggler rule of ``dynprof analyze``.

:func:`sample_stragglers` asks the source for the traces
(:meth:`~dynprof.watch.sources.WatchSource.trace`: through the nodes' sidecars as ``dynprof
start --job J --hosts ... --steps N --fetch DIR`` goes, or through this node's agents), reduces
each rank's trace and combines the job's analysis
(:func:`collectors.trace_analysis.rank.analyze_ranks`,
:func:`collectors.trace_analysis.job.combine`), and judges it with the rule
(:mod:`dynprof.watch.straggler.rule`). It is the watch's first sampled signal (its row is
:data:`dynprof.watch.signals.STRAGGLER`): :func:`sampler_for` is its
:class:`~dynprof.watch.sampler.Sampler` for the watch's source.

A sample is bounded (``limit_s``) and never raises: a trace that fails, a node that does not
answer, an analysis that finds nothing, each is a note in the report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collectors.torch_trace import TRACE_FILE
from collectors.trace_analysis.job import combine
from collectors.trace_analysis.rank import RankInput, analyze_ranks, device_of
from dynprof import store, untrusted
from dynprof.errors import DynprofError
from dynprof.watch.signals import STRAGGLER
from dynprof.watch.sources import WatchSource
from dynprof.watch.straggler.rule import StragglerReport, judge
from dynprof.watch.traces import SampledTraces, failed_note

log = logging.getLogger("dynprof.watch.straggler")

SAMPLE_STEPS = 2
SAMPLE_LIMIT_S = 120.0
"""How long one sample may take in all (arming, tracing, fetching, analysis)."""
SAMPLE_EVERY_S = STRAGGLER.every_s
"""The default interval between samples (``--sample-every``): one sample costs the ranks about
half a second to a second of training (scripts/bench_watch_sampling.py measures it), so one
every ten minutes is under 0.2 % of the job's time, inside the 0.5 % budget."""


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


def sample_stragglers(
    source: WatchSource, job: str, *, steps: int = SAMPLE_STEPS, limit_s: float = SAMPLE_LIMIT_S
) -> StragglerReport:
    """One sampled trace of ``steps`` steps of every rank of ``job`` the source reads, analysed
    for a straggler. Never raises: what went wrong is the report's ``note``. Once judged, the
    sample's traces are handed back to the source (kept, or removed)."""
    started = time.monotonic()
    report = StragglerReport(sampled_at=time.time(), steps=steps)
    traces: SampledTraces | None = None
    try:
        traces = source.trace(job, steps, limit_s)
        report.at_step = traces.at_step
        report.groups = traces.groups
        report.traces = traces.traces
        if traces.note:
            report.note = traces.note
            return report
        analysis, reduced = analyse_fetched(traces.fetched, traces.label_of)
        notes = [*traces.notes]
        notes += [f"rank {e.get('rank')} not analysed: {e.get('error')}" for e in analysis.get("errors") or []]
        judge(report, job, analysis, reduced, notes, steps)
        if report.verdict is not None:
            report.verdict.evidence["samples"].update(traces.evidence)
        return report
    except Exception as exc:  # a sample that fails is a note, never the watch's end
        log.debug("straggler sample of %s failed", job, exc_info=exc)
        report.note = failed_note(exc)
        return report
    finally:
        report.cost_s = round(time.monotonic() - started, 3)
        if traces is not None:
            traces.done(report.verdict is not None)


class StragglerSampler:
    """The straggler signal as the watch's engine runs it
    (:class:`~dynprof.watch.sampler.Sampler`): every ``every_s``, one sample of the job
    (:func:`sample_stragglers`) through ``source``; a sample that raises is said as a sample that
    failed."""

    name = STRAGGLER.name

    def __init__(
        self,
        source: WatchSource,
        every_s: float | None,
        *,
        steps: int = SAMPLE_STEPS,
        limit_s: float = SAMPLE_LIMIT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.every_s = every_s
        self.steps = steps
        self.limit_s = limit_s
        self.clock = clock

    def sample(self, job: str) -> StragglerReport | None:
        try:
            return sample_stragglers(self.source, job, steps=self.steps, limit_s=self.limit_s)
        except Exception as exc:  # a failed sample is said, the watch goes on
            log.warning("dynprof watch: the straggler sample failed: %s", exc)
            return StragglerReport(sampled_at=self.clock(), steps=0, note=f"the sample failed: {exc}"[:2000])


def sampler_for(source: Any, every_s: float | None) -> StragglerSampler:
    """The straggler's sampler for a watch's source (the factory of its row in
    :data:`~dynprof.watch.signals.SIGNALS`): its samples go through the very source (nodes,
    client and token) that reads the progress, so a sample goes to exactly the addresses the
    user named; over this node's agents, its traces are analysed in this machine's store."""
    return StragglerSampler(source, every_s)
