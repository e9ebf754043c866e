"""What the watch's engine runs beside its progress polls: a list of samplers, each on its schedule.

A :class:`Sampler` is one sampled signal of a job (its row in
:data:`dynprof.watch.signals.SIGNALS` says the rest): ``name``, ``every_s`` (seconds between two
samples; None or 0: never) and ``sample(job)``, which takes one sample of the job on the nodes it
was built for and returns a :class:`SignalReport`. The engine
(:class:`dynprof.watch.engine.WatchEngine`) starts a sample on its own thread when one is due,
one at a time per sampler and none during a stall; with the report it keeps
the report's gauges (``/metrics`` exports them), publishes its verdict, if any, as every
verdict is published, and hands the report to the face (``--json``: an event named
``<name>_sample`` with the report's ``to_json()``; stderr: its ``line()``). The engine knows no
signal by name.

:func:`samplers_for` builds every signal's sampler for a watch's source, with the intervals the
user chose.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from dynprof.watch.model import RankValues, Verdict
from dynprof.watch.signals import Signal, all_signals


@runtime_checkable
class SignalReport(Protocol):
    """What one sample of a signal found."""

    @property
    def signal(self) -> str:
        """The sampler's (and its signal's) name."""
        ...

    @property
    def verdict(self) -> Verdict | None:
        """A verdict of the signal's kind when the sample found something to say, else None."""
        ...

    def gauges(self) -> Mapping[str, RankValues]:
        """This sample's value of each of the signal's gauges, per (host, rank), by gauge name."""
        ...

    def to_json(self) -> dict[str, Any]:
        """The ``sample`` of its ``--json`` event."""
        ...

    def line(self) -> str:
        """One line for people on what the sample found (or why it found nothing)."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """One sampled signal of a job, as the engine runs it."""

    @property
    def name(self) -> str: ...

    @property
    def every_s(self) -> float | None:
        """Seconds between two samples (from one's start to the next's); None or 0: never."""
        ...

    def sample(self, job: str) -> SignalReport | None:
        """One sample of ``job``, bounded in time; what went wrong is said in the report, never
        raised (the engine logs what is raised and goes on). None: nothing to say."""
        ...


SamplerFactory = Callable[[Any, "float | None"], Sampler]
"""``factory(source, every_s)``: a signal's sampler for the watch's source (a
:class:`~dynprof.watch.sources.SidecarSource`, or the face's source over this node's agents)."""


def factory_of(signal: Signal) -> SamplerFactory:
    """The signal's sampler factory (``"module:function"`` is imported now)."""
    if not isinstance(signal.sampler, str):
        return signal.sampler
    module, _, function = signal.sampler.partition(":")
    made: SamplerFactory = getattr(importlib.import_module(module), function)
    return made


def samplers_for(
    source: Any, every: Mapping[str, float | None], signals: Sequence[Signal] | None = None
) -> list[Sampler]:
    """Every signal's sampler (of ``signals``, default :data:`~dynprof.watch.signals.SIGNALS`)
    for ``source``; ``every``: a signal's interval by its name (None: never; a signal not in it
    samples at its default)."""
    chosen = all_signals() if signals is None else signals
    return [factory_of(s)(source, every.get(s.name, s.every_s)) for s in chosen]


__all__ = ["Sampler", "SamplerFactory", "SignalReport", "factory_of", "samplers_for"]
