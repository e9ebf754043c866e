"""``GET /metrics``: the sidecar's Prometheus exposition, written with ``prometheus_client``.

A custom collector builds the metric families from the progress book (:mod:`.progress`) at
each scrape, into a private registry (never the library's global one, which would add the
server's own process metrics to every test and mix several apps in one process). docs/metrics.md
is the reference; the names are what ``scripts/deploy/dynprof-alerts.yml`` and the watch use.

Per rank of a job on this node (labels ``job_id``, ``host``, ``rank``): steps (counter), a
step-time histogram (10 buckets), seconds since the last step, agent up; per job: artifacts
in the node's store by kind (counter, cached ``CAPTURE_TTL_S``), the stall time; with a hosted
watch: stalled, each sampled signal's gauges per rank (its row of
:data:`dynprof.watch.signals.SIGNALS`: the straggler score), verdicts. Labels are bounded: never
a pid or a command line, and valid text (:func:`text_label`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from dynprof import __version__
from dynprof.errors import ArtifactError
from dynprof.renderers import RENDERERS
from dynprof.safetext import valid_text
from dynprof.sidecar.progress import STEP_BUCKETS, BookView, ProgressBook
from dynprof.store import ArtifactStore
from dynprof.watch.model import VERDICT_KIND, WatchGauges, verdict_kinds
from dynprof.watch.signals import SIGNALS, all_signals

# generate_latest writes the classic text format (legacy names, no UTF-8 names): version 0.0.4,
# which every Prometheus reads (the library's "latest", 1.0.0, labels the same text with a version
# that servers before 3.x do not know).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
CAPTURE_TTL_S = 15.0  # the store is scanned at most once in this time
# The kinds counted by dynprof_captures_total; an artifact of any other kind counts as "other".
CAPTURE_KINDS = tuple(sorted({*RENDERERS, "healthcheck", VERDICT_KIND}))
MAX_WATCH_JOBS = 256
MAX_LABEL = 200  # characters of a label value (a job id, a host name)
MAX_SCORES_PER_JOB = 4096  # series of one gauge of a signal, per job
SERIES_PER_RANK = 1 + (len(STEP_BUCKETS) + 1 + 2) + 1 + 1  # steps, histogram, since step, agent up
SERIES_PER_RANK_WITH_WATCH = SERIES_PER_RANK + sum(len(s.gauges) for s in SIGNALS)  # the signals' gauges


def rank_label(rank: int | None) -> str:
    return "none" if rank is None else str(rank)


def text_label(value: object) -> str:
    """A label value from what an agent or a node said (a job id, a host), cut to MAX_LABEL
    characters, as valid text (:func:`dynprof.safetext.valid_text`: bytes that are not UTF-8
    as ``\\xNN``), so that one agent's odd id can never fail the whole exposition. Quotes,
    backslashes and newlines are the exposition's to escape, and it does."""
    return valid_text(str(value))[:MAX_LABEL]


class CaptureCounts:
    """Artifacts in the store by (job, kind), from one scan at most every ``ttl_s`` seconds;
    while a scan runs, other scrapes answer the previous counts."""

    def __init__(self, store: ArtifactStore, ttl_s: float = CAPTURE_TTL_S) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._at = -float("inf")
        self.scans = 0

    def counts(self) -> dict[tuple[str, str], int]:
        if time.monotonic() - self._at < self._ttl_s or not self._lock.acquire(blocking=False):
            return self._counts
        try:
            if time.monotonic() - self._at >= self._ttl_s:
                self._counts = self._scan()
                self._at = time.monotonic()
                self.scans += 1
            return self._counts
        finally:
            self._lock.release()

    def _scan(self) -> dict[tuple[str, str], int]:
        try:
            arts, _ = self._store.scan()
        except (ArtifactError, OSError):  # a store dynprof refuses: no counts, the rest is exported
            return {}
        out: dict[tuple[str, str], int] = {}
        for a in arts:
            kind = a.kind if a.kind in CAPTURE_KINDS else "other"
            key = (str(a.manifest.get("job") or ""), kind)
            out[key] = out.get(key, 0) + 1
        return out


class SidecarCollector(Collector):
    """The families of one scrape, from the book (and a hosted watch's gauges)."""

    def __init__(
        self,
        book: ProgressBook,
        captures: CaptureCounts,
        watch_gauges: Callable[[], list[WatchGauges]] | None = None,
        view: Callable[[], BookView] | None = None,
    ) -> None:
        self._book = book
        self._captures = captures
        self._watch_gauges = watch_gauges
        self._view = view or book.view

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        host = text_label(view.host)
        now = time.time()
        labels = ["job_id", "host", "rank"]
        steps = CounterMetricFamily("dynprof_rank_steps", "Optimizer steps the rank completed.", labels=labels)
        hist = HistogramMetricFamily(
            "dynprof_rank_step_seconds",
            "Step durations, from the steps taken between two polls of the rank's agent at their mean duration.",
            labels=labels,
        )
        since = GaugeMetricFamily(
            "dynprof_rank_seconds_since_step", "Seconds since the rank's last step (node clock).", labels=labels
        )
        up = GaugeMetricFamily(
            "dynprof_rank_agent_up", "1 when the rank's agent answered the last poll, 0 when not.", labels=labels
        )
        jobs: dict[str, str] = {}  # job_id label -> the job's id (cut to MAX_LABEL characters)
        seen: set[tuple[str, str]] = set()
        for (job, rank), entry in sorted(view.entries.items(), key=lambda kv: (kv[0][0], rank_label(kv[0][1]))):
            label = text_label(job)
            if jobs.setdefault(label, job) != job or (label, rank_label(rank)) in seen:
                continue  # two ids alike in their first MAX_LABEL characters: one series, the first
            seen.add((label, rank_label(rank)))
            values = [label, host, rank_label(rank)]
            row = entry.row
            steps.add_metric(values, row.step)
            h = entry.histogram
            cumulative = []
            total = 0
            for bound, n in zip((*(f"{b:g}" for b in STEP_BUCKETS), "+Inf"), h.counts):
                total += n
                cumulative.append((bound, float(total)))
            hist.add_metric(values, cumulative, h.total_s)
            if entry.gone:  # the process ended: neither an agent down nor a stall
                continue
            if row.last_step_at > 0:
                since.add_metric(values, max(0.0, now - row.last_step_at))
            up.add_metric(values, 1.0 if row.agent == "up" else 0.0)
        yield steps
        yield hist
        yield since
        yield up
        stall = GaugeMetricFamily(
            "dynprof_stall_after_seconds",
            "Seconds without a step of any rank after which the job counts as stalled.",
            labels=["job_id", "host"],
        )
        for label, job in sorted(jobs.items()):
            stall.add_metric([label, host], self._book.stall_after_of(job, view))
        yield stall
        captures = CounterMetricFamily(
            "dynprof_captures", "Artifacts of the job in the node's store, by kind.", labels=["job_id", "host", "kind"]
        )
        counts = self._captures.counts()
        for label, job in sorted(jobs.items()):
            for kind in (*CAPTURE_KINDS, "other"):
                n = counts.get((job, kind), 0)
                if n:
                    captures.add_metric([label, host, kind], n)
        yield captures
        if self._watch_gauges is not None:
            yield from self._watch_families()
        info = GaugeMetricFamily("dynprof_sidecar_info", "This sidecar's dynprof version.", labels=["version"])
        info.add_metric([__version__], 1.0)
        yield info

    def _watch_families(self) -> Iterator[Metric]:
        assert self._watch_gauges is not None
        stalled = GaugeMetricFamily(
            "dynprof_watch_stalled", "1 when no rank of the job advanced for its stall time.", labels=["job_id"]
        )
        ranked = [  # each signal's gauges per rank, by their rows (the straggler's score)
            (signal.name, gauge.name, GaugeMetricFamily(gauge.metric, gauge.help, labels=["job_id", "host", "rank"]))
            for signal in all_signals()
            for gauge in signal.gauges
        ]
        verdicts = CounterMetricFamily(
            "dynprof_watch_verdicts", "Verdicts the watch wrote, by kind.", labels=["job_id", "kind"]
        )
        try:
            gauges = list(self._watch_gauges())[:MAX_WATCH_JOBS]
        except Exception:  # a hosted watch's failure never takes the rest of the scrape down
            gauges = []
        seen: set[str] = set()
        for g in gauges:
            if not isinstance(g, WatchGauges) or text_label(g.job) in seen:
                continue
            job = text_label(g.job)
            seen.add(job)
            stalled.add_metric([job], 1.0 if g.stalled else 0.0)
            for signal, gauge, family in ranked:
                scored: set[tuple[str, str]] = set()
                for (host, rank), value in sorted(g.rank_values(signal, gauge).items())[:MAX_SCORES_PER_JOB]:
                    key = (text_label(host), text_label(rank))
                    if key not in scored:
                        scored.add(key)
                        family.add_metric([job, *key], float(value))
            for kind in verdict_kinds():
                if kind in g.verdicts:
                    verdicts.add_metric([job, kind], float(g.verdicts[kind]))
        yield stalled
        for _, _, family in ranked:
            yield family
        yield verdicts


def registry_of(collector: Collector) -> CollectorRegistry:
    """A private registry holding ``collector`` alone."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry`` (content type :data:`CONTENT_TYPE`)."""
    return generate_latest(registry)
