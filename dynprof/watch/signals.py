"""The watch's sampled signals, one row each: what the rest of dynprof reads of a signal by its name.

Besides its stall and hang decisions, the watch samples the job now and then (a *signal*: the
straggler's aligned trace of a couple of steps is the first). What samples is a
:class:`~dynprof.watch.sampler.Sampler`, built for the watch's source by the row's ``sampler``
factory; what each sample found is a :class:`~dynprof.watch.sampler.SignalReport`. Everything
else the watch needs to know of a signal is here, in its :class:`Signal` row of
:data:`SIGNALS`, read by name:

- ``dynprof watch`` and ``serve --watch`` take its interval option (``flag``, default
  ``every_s``) and build its sampler (:func:`dynprof.watch.sampler.samplers_for`);
- the verdicts it writes are of kind ``verdict_kind``, which the verdict's decoder accepts
  (:func:`dynprof.watch.model.verdict_kinds`) and ``/metrics`` counts;
- ``/metrics`` exports each of its per-rank ``gauges`` as a Prometheus gauge;
- a verdict of its kind is headed ``label`` on the page, whose rank table shows its
  ``rank_columns``;
- with ``--json`` each sample is an event named ``<name>_sample``.

This module is data: it imports nothing of the watch (the verdict's model reads it), and a
row names its sampler factory by ``"module:function"``, imported when a watch starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RankGauge:
    """A value per (host, rank) a signal's samples give, exported on ``/metrics`` (labels
    ``job_id``, ``host``, ``rank``) by a watch a sidecar hosts."""

    name: str  # its key in the report's gauges(): "score"
    metric: str  # the Prometheus family: "dynprof_watch_straggler_score"
    help: str


@dataclass(frozen=True, slots=True)
class Signal:
    """One sampled signal of the watch (see the module's docstring)."""

    name: str  # the sampler's name; its --json event is "<name>_sample"
    flag: str  # the option of its interval in seconds (0: never), "--sample-every"
    every_s: float  # the option's default
    help: str  # the option's help
    # The factory of its sampler: ``factory(source, every_s) -> Sampler`` for the watch's
    # source (the nodes' sidecars, or this node's agents); "module:function", or the function.
    sampler: str | Callable[..., Any]
    verdict_kind: str | None = None  # the kind of the verdicts it writes; None: it writes none
    label: str = ""  # the page's heading of such a verdict
    gauges: tuple[RankGauge, ...] = ()
    rank_columns: tuple[str, ...] = ()  # keys of its verdicts' rank rows the page shows as columns

    @property
    def event(self) -> str:
        """The ``event`` of its samples' ``--json`` documents."""
        return sample_event(self.name)

    @property
    def dest(self) -> str:
        """The attribute of its interval option on the parsed arguments."""
        return self.flag.lstrip("-").replace("-", "_")


STRAGGLER = Signal(
    name="straggler",
    flag="--sample-every",
    # One sample costs the ranks about half a second to a second of training
    # (scripts/bench_watch_sampling.py), so one every ten minutes is under 0.2 % of the job's
    # time, inside the 0.5 % budget (dynprof.watch.straggler.sampler.SAMPLE_EVERY_S).
    every_s=600.0,
    help="every SEC take an aligned trace of a couple of steps on every rank (through the sidecars, or this "
    "node's agents without node options) and run analyze's straggler rule (default 600: about 0.1 %% of "
    "training time, docs/watch-stragglers.md; 0: never)",
    sampler="dynprof.watch.straggler.sampler:sampler_for",
    verdict_kind="straggler",  # one rank holds the others back
    label="Straggler",
    gauges=(
        RankGauge(
            "score",
            "dynprof_watch_straggler_score",
            "The rank's straggler score from the watch's last sampled trace (0: not a straggler).",
        ),
    ),
    rank_columns=("step_ms", "work_ms", "collective_ms", "score"),
)

SIGNALS: tuple[Signal, ...] = (STRAGGLER,)
"""Every sampled signal of the watch, in the order its options, gauges and verdict kinds are
listed. A new signal is one row here and its own module."""


def sample_event(name: str) -> str:
    """The ``event`` of a ``--json`` document that says what a sample of signal ``name`` found."""
    return f"{name}_sample"


def all_signals() -> tuple[Signal, ...]:
    """:data:`SIGNALS`, read when asked (a row added after import, as a test does, counts)."""
    return SIGNALS


def signal_named(name: str) -> Signal | None:
    return next((s for s in all_signals() if s.name == name), None)


def signal_of_kind(kind: str) -> Signal | None:
    """The signal whose verdicts are of ``kind``; None for the watch's own kinds."""
    return next((s for s in all_signals() if s.verdict_kind == kind), None)


def rank_columns() -> tuple[str, ...]:
    """The signals' rank columns, each once, in their order."""
    return tuple(dict.fromkeys(c for s in all_signals() for c in s.rank_columns))


__all__ = [
    "SIGNALS",
    "STRAGGLER",
    "RankGauge",
    "Signal",
    "all_signals",
    "rank_columns",
    "sample_event",
    "signal_named",
    "signal_of_kind",
]
