"""Analyse the traces of a job kept in the store: the analysis kind's one collection policy,
whoever asks for it (``dynprof analyze``).

    >>> got = collect(AnalysisRequest(job="j1"), ArtifactStore())       # doctest: +SKIP
    >>> got.data["straggler"], got.saved                                # doctest: +SKIP
    >>> diff = collect(AnalysisRequest(compare=("g1", "g2")), store)    # doctest: +SKIP

What is analysed is named one of three ways: trace artifacts (one per rank; or one ``analysis``
artifact, read back as it was saved), a job-wide trace group (``group``, a group id or a unique
prefix of one, in ``job`` if given), or a job's latest job-wide group (``job``). One trace per
rank is read (with several of one rank, the newest); each rank's trace in a process of its own
(:func:`collectors.trace_analysis.rank.analyze_ranks`), the ranks combined and the straggler
judged by :func:`collectors.trace_analysis.job.combine`. The analysis is saved as an
``analysis`` artifact beside the traces unless the request says not to.

``compare`` names two sides, A and B, each a trace group id, an ``analysis`` artifact or a trace
artifact: each side is analysed (or read back) and B minus A returned
(:func:`collectors.trace_analysis.job.compare`); nothing is saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from collectors.torch_trace import TRACE_FILE
from collectors.trace_analysis.artifact import ANALYSIS_FILE, KIND, load_analysis
from collectors.trace_analysis.job import combine, compare
from collectors.trace_analysis.rank import RankInput, analyze_ranks, device_of
from collectors.trace_analysis.reader import TraceError
from dynprof import errors
from dynprof.output import printable
from dynprof.requests import read_options
from dynprof.result import Result
from dynprof.store import Artifact, ArtifactStore
from dynprof.untrusted import max_trace_bytes

MAX_TOP = 10_000
MAX_WORKERS = 1024
TOP_ANALYSED = 50  # an analysis keeps at least this many kernels and operators (shown: ``top``)
TOP_COMPARED = 200  # each side of a comparison keeps this many


@dataclass(frozen=True)
class AnalysisRequest:
    """What to analyse: trace ``artifacts`` (or one ``analysis`` artifact), a trace ``group``
    and/or a ``job`` (its latest job-wide group), or the two sides of ``compare``; how (``top``
    rows in the kernel and operator tables, ``workers`` processes, 0 for one per CPU;
    ``max_bytes``, the largest decompressed trace read, ``None`` for ``DYNPROF_MAX_TRACE_BYTES``
    or its default); and whether the analysis is kept as an artifact (``save``). Checked when
    made: a bad request raises :class:`~dynprof.errors.UsageError`, never a failure further
    down."""

    artifacts: tuple[str, ...] = ()
    job: str | None = None
    group: str | None = None
    compare: tuple[str, ...] | None = None
    top: int = 10
    workers: int = 0
    max_bytes: int | None = None
    save: bool = True

    def __post_init__(self) -> None:
        if self.top < 1:
            raise errors.UsageError("--top must be 1 or more")
        if self.top > MAX_TOP:
            raise errors.UsageError(f"--top must be at most {MAX_TOP}")
        if not 0 <= self.workers <= MAX_WORKERS:
            raise errors.UsageError(f"--workers must be 0 to {MAX_WORKERS}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise errors.UsageError("--max-trace-bytes must be 0 or more bytes")
        if self.compare is not None:
            if len(self.compare) != 2:
                raise errors.UsageError("--compare takes two trace groups or artifacts, A and B")
            if self.artifacts:
                raise errors.UsageError("give either ARTIFACT... or --compare A B, not both")
            return
        if self.artifacts and (self.job or self.group):
            raise errors.UsageError("give either ARTIFACT... or --job/--group, not both")
        if not self.artifacts and not self.job and not self.group:
            raise errors.UsageError(
                "nothing to analyse", help="Give trace artifacts (`dynprof ls --kind trace`) or --job JOB."
            )

    OPTIONS: ClassVar[dict[str, str]] = {
        "artifacts": "strs",
        "job": "str",
        "group": "str",
        "compare": "strs",
        "top": "int",
        "workers": "int",
        "max_trace_bytes": "int",
        "no_save": "bool",
    }

    @classmethod
    def from_json(cls, doc: Any) -> AnalysisRequest:
        """The request of a JSON object of ``dynprof analyze``'s options (:meth:`to_json`):
        ``artifacts`` and ``compare`` are lists of artifact ids or group ids (``compare`` of
        two), ``max_trace_bytes`` a number of bytes."""
        o = read_options(doc, cls.OPTIONS, "analyze")
        compared = o.get("compare")
        return cls(
            artifacts=tuple(o.get("artifacts", ())),
            job=o.get("job"),
            group=o.get("group"),
            compare=tuple(compared) if compared is not None else None,
            top=o.get("top", 10),
            workers=o.get("workers", 0),
            max_bytes=o.get("max_trace_bytes"),
            save=not o.get("no_save", False),
        )

    def to_json(self) -> dict[str, Any]:
        """The request as a JSON object of options (those left unset out)."""
        out: dict[str, Any] = {"top": self.top}
        if self.artifacts:
            out["artifacts"] = list(self.artifacts)
        for key in ("job", "group"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.compare is not None:
            out["compare"] = list(self.compare)
        if self.workers:
            out["workers"] = self.workers
        if self.max_bytes is not None:
            out["max_trace_bytes"] = self.max_bytes
        if not self.save:
            out["no_save"] = True
        return out

    def trace_limit(self) -> int:
        """The largest decompressed trace read: the request's, else ``DYNPROF_MAX_TRACE_BYTES``."""
        return self.max_bytes if self.max_bytes is not None else max_trace_bytes()


class Analysis(Result):
    """One analysis (``data``: the analysis document) of what ``label`` says, the artifact it
    was saved as (``saved``), and whether it was read back from a saved one (``loaded``). Its
    JSON is the document with its tables cut to ``top`` rows and the artifact's id; its
    messages name each rank not analysed (the document's ``errors``)."""

    def __init__(
        self, data: dict[str, Any], label: str, saved: Artifact | None, top: int, loaded: bool = False
    ) -> None:
        messages = [
            printable(f"warning: rank {e.get('rank')} not analysed: {e['error']}") for e in data.get("errors") or []
        ]
        super().__init__({}, 0, messages)
        self.data = data
        self.label = label
        self.saved = saved
        self.loaded = loaded
        self.top = top

    def to_json(self) -> dict[str, Any]:
        out = dict(self.data)
        out["top_kernels"] = out.get("top_kernels", [])[: self.top]
        out["top_ops"] = out.get("top_ops", [])[: self.top]
        out["artifact"] = self.saved.id if self.saved else None
        return out


class Comparison(Result):
    """``compare``: B minus A (``comparison``), with what each side was."""

    def __init__(self, comparison: dict[str, Any], a_label: str, b_label: str) -> None:
        super().__init__({}, 0, [])
        self.comparison = comparison
        self.a_label = a_label
        self.b_label = b_label

    def to_json(self) -> dict[str, Any]:
        return {**self.comparison, "a": {"label": self.a_label}, "b": {"label": self.b_label}}


def collect(request: AnalysisRequest, store: ArtifactStore) -> Analysis | Comparison:
    """The analysis the request names, from the traces in ``store`` (saved there unless the
    request says not to); with ``compare``, the comparison of its two sides
    (:func:`collect_comparison`)."""
    if request.compare is not None:
        return collect_comparison(request, store)
    max_bytes = request.trace_limit()
    if request.artifacts:
        arts = [store.get(ref) for ref in request.artifacts]
        if len(arts) == 1 and arts[0].kind == KIND:
            return Analysis(load(arts[0]), f"saved analysis {arts[0].id}", arts[0], request.top, loaded=True)
        label = ", ".join(a.id for a in arts)
    else:
        arts = find_group(store, request.job, request.group)
        label = f"job {arts[0].manifest.get('job')}, group {group_of(arts[0]) or '-'}"
    traces = check_traces(arts)
    t0 = time.perf_counter()
    data = analyse(traces, top=max(TOP_ANALYSED, request.top), workers=request.workers or None, max_bytes=max_bytes)
    data["elapsed_s"] = round(time.perf_counter() - t0, 3)
    if len(data["ranks"]) == 0:
        raise errors.DynprofError(
            "no trace could be analysed: " + "; ".join(e["error"] for e in data["errors"]),
            help="Check the traces with `dynprof show ARTIFACT --verify`.",
        )
    saved = save(store, traces, data) if request.save else None
    return Analysis(data, label, saved, request.top)


def collect_comparison(request: AnalysisRequest, store: ArtifactStore) -> Comparison:
    """B minus A of the request's ``compare`` (each a trace group id, in the request's ``job`` if
    given, an ``analysis`` artifact or a trace artifact). Nothing is saved."""
    if request.compare is None:
        raise errors.UsageError("nothing to compare", help="Give --compare A B.")
    max_bytes = request.trace_limit()
    a_ref, b_ref = request.compare
    a_label, a = _analysis_of(store, request, a_ref, max_bytes)
    b_label, b = _analysis_of(store, request, b_ref, max_bytes)
    return Comparison(compare(a, b, top=request.top), a_label, b_label)


def _analysis_of(
    store: ArtifactStore, request: AnalysisRequest, ref: str, max_bytes: int
) -> tuple[str, dict[str, Any]]:
    arts = group_artifacts(store, ref, request.job)
    if arts:
        label = f"group {ref}"
    else:
        art = store.get(ref)
        if art.kind == KIND:
            return f"analysis {art.id}", load(art)
        arts = [art]
        label = f"trace {art.id}"
    data = analyse(check_traces(arts), top=TOP_COMPARED, workers=request.workers or None, max_bytes=max_bytes)
    if not data["ranks"]:
        raise errors.DynprofError(
            f"no trace of {ref!r} could be analysed: " + "; ".join(e["error"] for e in data["errors"])
        )
    return label, data


def group_of(art: Artifact) -> str:
    """The job-wide trace group of a trace artifact (``""`` for a trace of its own)."""
    opts = art.manifest.get("options")
    return str(opts.get("group_id") or "") if isinstance(opts, dict) else ""


def group_artifacts(store: ArtifactStore, group: str, job: str | None = None) -> list[Artifact]:
    """The finished trace artifacts of a group (a group id or a unique prefix of one)."""
    arts = [a for a in store.list(job=job, kind="trace") if a.status in ("complete", "partial") and group_of(a)]
    exact = [a for a in arts if group_of(a) == group]
    if exact:
        return exact
    ids = {group_of(a) for a in arts if group_of(a).startswith(group)}
    if len(ids) > 1:
        raise errors.DynprofError(f"{group!r} matches {len(ids)} trace groups", help="Give more of the group id.")
    return [a for a in arts if group_of(a) in ids]


def find_group(store: ArtifactStore, job: str | None, group: str | None) -> list[Artifact]:
    """The artifacts of ``group`` (in ``job`` if given), or the job's latest job-wide group."""
    if group:
        arts = group_artifacts(store, group, job)
        if not arts:
            raise errors.DynprofError(
                f"no trace group {group!r}" + (f" in job {job!r}" if job else ""),
                help="`dynprof ls --kind trace --json` lists traces; their options.group_id is the group.",
            )
        return arts
    traces = [a for a in store.list(job=job, kind="trace") if a.status in ("complete", "partial")]
    grouped = [a for a in traces if group_of(a)]
    if not grouped:
        raise errors.DynprofError(
            f"no job-wide trace of job {job!r} in {store.root}",
            help=f"Trace every rank with `dynprof start --job {job} --steps 5`, then analyse.",
        )
    latest = max(grouped, key=lambda a: a.created_at)
    return [a for a in grouped if group_of(a) == group_of(latest)]


def check_traces(arts: list[Artifact]) -> list[Artifact]:
    """The traces to analyse of ``arts``: each a trace artifact with its trace file, one per
    rank (with several of the same host, rank and process, the newest)."""
    bad = [a for a in arts if a.kind != "trace"]
    if bad:
        raise errors.UsageError(
            f"{bad[0].id} is a {bad[0].kind} artifact, not a trace",
            help="Give trace artifacts (`dynprof ls --kind trace`), or one analysis artifact to print it.",
        )
    missing = [a for a in arts if not a.has_file(TRACE_FILE)]
    if missing:
        raise errors.ArtifactError(f"{missing[0].id} has no {TRACE_FILE} ({missing[0].status})")
    by_rank: dict[Any, Artifact] = {}
    for a in sorted(arts, key=lambda a: a.created_at):
        key = (a.manifest.get("host"), a.manifest.get("rank"), a.manifest.get("pid"))
        by_rank[key] = a
    return list(by_rank.values())


def analyse(arts: list[Artifact], top: int, workers: int | None, max_bytes: int) -> dict[str, Any]:
    """The job-wide analysis of trace artifacts (one per rank), ``workers`` processes reading
    them (``None``: one per CPU), none read past ``max_bytes`` decompressed."""
    items = [
        RankInput(
            path=str(a.file(TRACE_FILE)),
            rank=a.manifest.get("rank"),
            host=a.manifest.get("host"),
            artifact=a.id,
            max_bytes=max_bytes,
            device=device_of(a.manifest),
        )
        for a in arts
    ]
    sources = [
        {"artifact": a.id, "rank": a.manifest.get("rank"), "host": a.manifest.get("host"), "group_id": group_of(a)}
        for a in arts
    ]
    return combine(analyze_ranks(items, workers=workers), top=top, sources=sources)


def save(store: ArtifactStore, arts: list[Artifact], data: dict[str, Any]) -> Artifact:
    """``data``, the analysis of ``arts``, kept as an ``analysis`` artifact in ``store``."""
    jobs = {a.manifest.get("job") for a in arts}
    groups = sorted({group_of(a) for a in arts if group_of(a)})
    writer = store.create(
        KIND,
        job=str(next(iter(jobs))) if len(jobs) == 1 and None not in jobs else None,
        options={"group_id": groups[0] if len(groups) == 1 else None, "sources": [a.id for a in arts]},
    )
    with writer:
        writer.write_json(ANALYSIS_FILE, data)
        s = data.get("straggler")
        return writer.finish(
            "complete",
            summary={
                "ranks": len(data["ranks"]),
                "steps": len(data.get("common_steps") or []),
                "straggler_rank": s["rank"] if s else None,
                "elapsed_s": data.get("elapsed_s"),
            },
        )


def load(art: Artifact) -> dict[str, Any]:
    """A saved ``analysis`` artifact's document; a damaged one is an
    :class:`~dynprof.errors.ArtifactError`."""
    try:
        return load_analysis(art)
    except TraceError as exc:
        raise errors.ArtifactError(str(exc)) from None
