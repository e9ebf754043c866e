"""A sample's traces: what a watch source hands the straggler's sampler
(:class:`SampledTraces`), and how the traces a watch's samples wrote in this machine's store are
kept (:class:`SampleTraces`).

Each source takes one aligned trace of a couple of steps of the job's ranks its own way (the
nodes' sidecars: armed at one step, followed, fetched; this node's agents: the trace kind's own
start, :func:`local_trace`) and hands back the same thing: the trace artifacts to analyse, each
with its node, the notes of what went wrong, and the step the traces start at.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.torch_trace.collect import Started
from dynprof import store
from dynprof.errors import DynprofError

log = logging.getLogger("dynprof.watch.straggler")

MAX_TRACE_DURATION_S = 300.0
"""The hard cap each agent puts on a sampled trace: it ends by itself past it."""

KEEP_SAMPLES = 3
"""The sampled traces a watch leaves in the store it traces into: those of its latest
``KEEP_SAMPLES`` samples, and those of every sample that named a straggler (its verdict lists
them); the others' are deleted once they are older than that."""


@dataclass
class SampledTraces:
    """One sample's traces as a source took them (:meth:`~dynprof.watch.sources.WatchSource.trace`).

    ``fetched``: rows ``{"path", "node", "id", "error"?}`` (those of
    :func:`dynprof.job.fetch.fetch_by_path`), each a trace artifact in this machine's file system;
    ``label_of``: a row's ``node`` -> the node's name as the watch prints it. ``note``: why there
    is nothing to analyse (set: the sample decides nothing). ``notes``: what went wrong with some
    ranks (said after the rule's own line). ``evidence``: what a verdict's ``samples`` evidence
    keeps of how the traces were taken. ``done(named)`` is called once the sample is judged
    (``named``: it named a straggler): the source keeps or removes the traces then."""

    at_step: int | None = None
    fetched: list[dict[str, Any]] = field(default_factory=list)
    label_of: dict[str, str] = field(default_factory=dict)
    note: str = ""
    notes: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # the sample's trace groups on the nodes (sidecar samples)
    traces: list[str] = field(default_factory=list)  # trace artifacts it wrote in this machine's store (local)
    evidence: dict[str, Any] = field(default_factory=dict)
    done: Callable[[bool], None] = lambda named: None


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


def local_trace(job: str, steps: int, limit_s: float) -> dict[str, Any]:
    """A :data:`LocalTrace` of this node's agents: a trace of ``steps`` steps with stacks on them
    (the trace kind's own start, as ``dynprof start --job J --steps N --with-stack`` runs it),
    written in this machine's store, waited for."""
    from collectors.torch_trace.collect import TraceRequest, collect

    cap = min(MAX_TRACE_DURATION_S, max(10.0, limit_s))
    request = TraceRequest(job=job, steps=steps, with_stack=True, max_duration=cap, timeout=limit_s)
    return collect(request).to_json()


def local_traces(doc: Any, host: str) -> SampledTraces:
    """What a :data:`LocalTrace`'s document (read by :meth:`Started.from_json`) says of this
    node's sample: its traces in this machine's store (only those written for the sample's
    request count), the ranks' notes."""
    try:
        started = Started.from_json(doc)
    except DynprofError:  # not a start's answer: no trace written
        started = Started()
    results = started.results or []
    starts = [r["start_step"] for r in results if isinstance(r.get("start_step"), int) and r["start_step"] > 0]
    got = SampledTraces(at_step=min(starts) if starts else None)
    group = started.group_id
    written: list[str] = []
    for r in results[:4096]:
        path = r.get("artifact")
        who = f"rank {r.get('rank')} (pid {r.get('pid')})"
        if not (r.get("status") in ("complete", "partial") and isinstance(path, str) and path):
            got.notes.append(f"{who}: {str(r.get('error') or 'no trace')[:300]}")
        elif not is_sample_trace(path, group):  # an agent's answer names it: only this sample's traces count
            got.notes.append(f"{who}: {path[:300]!r} is not a trace of this sample in the store")
        else:
            written.append(path)
    if not written:
        got.note = ("no trace was written" + (": " + "; ".join(got.notes[:5]) if got.notes else ""))[:2000]
        return got
    got.traces = written[:64]
    got.fetched = [{"path": path, "node": host, "id": Path(path).name} for path in written]
    got.label_of = {host: host}
    got.evidence = {"traces": written[:64]}
    return got


def is_sample_trace(path: str, group: Any) -> bool:
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


def failed_note(exc: BaseException) -> str:
    """The note of a sample that failed: what was raised, for people."""
    message = exc.message if isinstance(exc, DynprofError) else f"{type(exc).__name__}: {exc}"
    return f"the sampled trace failed: {message}"[:2000]
