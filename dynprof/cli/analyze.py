"""`dynprof analyze`: where each rank's step time goes, and which rank holds the others back."""

from __future__ import annotations

import argparse
import time
from typing import Any

from dynprof import errors
from dynprof.cli._common import add_json, bounded_int, printable, printable_lines
from dynprof.result import Result
from dynprof.store import Artifact, ArtifactStore
from dynprof.units import parse_size


class AnalyzeCommand:
    """Analyse the traces of a job: per-rank step breakdown, straggler, top kernels and ops.

    dynprof analyze ARTIFACT...               the given trace artifacts (one per rank)
    dynprof analyze --job J [--group G]       a job-wide trace group (default: the latest one)
    dynprof analyze --compare A B             two groups or artifacts, before/after a change

    Per rank and step: CPU time in operators, in collectives, waiting for collectives and outside
    operators (Python, data loading); with GPU activities, GPU time in compute kernels,
    communication kernels (alone or overlapped with compute), memory copies and idle. Each set of
    categories adds up to the step time. The straggler is the rank whose work outside
    collectives is longest while the others wait in collectives (the noise threshold is printed).
    The analysis is saved as an `analysis` artifact beside the traces (`--no-save` to skip); the
    web page (`dynprof serve`) draws it. In --compare, A and B are each a trace group id, an
    `analysis` artifact or a trace artifact.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("artifacts", nargs="*", metavar="ARTIFACT", help="trace or analysis artifacts")
        parser.add_argument("--job", help="analyse this job's job-wide trace group")
        parser.add_argument("--group", help="the trace group id (`dynprof start` prints it; default: latest)")
        parser.add_argument(
            "--compare", nargs=2, metavar=("A", "B"), help="compare two trace groups or artifacts (B minus A)"
        )
        parser.add_argument(
            "--top", type=bounded_int(1, 10_000), default=10, help="rows in the kernel and operator tables (default 10)"
        )
        parser.add_argument(
            "--workers", type=bounded_int(0, 1024), default=0, help="parallel processes (default: one per CPU)"
        )
        parser.add_argument(
            "--max-trace-bytes",
            metavar="SIZE",
            help="refuse a trace larger than this once decompressed (default: DYNPROF_MAX_TRACE_BYTES, or 2G)",
        )
        parser.add_argument("--no-save", action="store_true", help="do not save the analysis as an artifact")
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        from collectors.trace_analysis.artifact import KIND
        from collectors.trace_analysis.job import compare

        if args.top < 1:
            raise errors.UsageError("--top must be 1 or more")
        from dynprof.untrusted import max_trace_bytes

        max_bytes = parse_size(args.max_trace_bytes) if args.max_trace_bytes else max_trace_bytes()
        store = ArtifactStore()
        if args.compare:
            if args.artifacts:
                raise errors.UsageError("give either ARTIFACT... or --compare A B, not both")
            a_label, a = self._analysis_of(store, args, args.compare[0], max_bytes)
            b_label, b = self._analysis_of(store, args, args.compare[1], max_bytes)
            return Comparison(compare(a, b, top=args.top), a_label, b_label)
        if args.artifacts and (args.job or args.group):
            raise errors.UsageError("give either ARTIFACT... or --job/--group, not both")
        if not args.artifacts and not args.job and not args.group:
            raise errors.UsageError(
                "nothing to analyse", help="Give trace artifacts (`dynprof ls --kind trace`) or --job JOB."
            )
        if args.artifacts:
            arts = [store.get(ref) for ref in args.artifacts]
            if len(arts) == 1 and arts[0].kind == KIND:
                return Analysis(args, _load(arts[0]), f"saved analysis {arts[0].id}", arts[0], loaded=True)
            label = ", ".join(a.id for a in arts)
        else:
            arts = find_group(store, args.job, args.group)
            label = f"job {arts[0].manifest.get('job')}, group {group_of(arts[0]) or '-'}"
        traces = _check_traces(arts)
        t0 = time.perf_counter()
        data = analyse(traces, top=max(50, args.top), workers=args.workers or None, max_bytes=max_bytes)
        data["elapsed_s"] = round(time.perf_counter() - t0, 3)
        if len(data["ranks"]) == 0:
            raise errors.DynprofError(
                "no trace could be analysed: " + "; ".join(e["error"] for e in data["errors"]),
                help="Check the traces with `dynprof show ARTIFACT --verify`.",
            )
        saved = None if args.no_save else save(store, traces, data)
        return Analysis(args, data, label, saved)

    def render(self, result: Result) -> str:
        from collectors.trace_analysis.render import render_compare_text, render_text

        if isinstance(result, Comparison):
            return printable_lines(render_compare_text(result.comparison, result.a_label, result.b_label))
        assert isinstance(result, Analysis)
        data = result.data
        text = printable(f"analysis of {result.label}") + "\n" + printable_lines(render_text(data, top=result.top))
        if data.get("elapsed_s") is not None and not result.loaded:
            text += f"\n\nanalysed in {data['elapsed_s']:.2f} s"
            text += f"; saved as {result.saved.id}" if result.saved else ""
        return text

    def _analysis_of(
        self, store: ArtifactStore, args: argparse.Namespace, ref: str, max_bytes: int
    ) -> tuple[str, dict[str, Any]]:
        from collectors.trace_analysis.artifact import KIND

        arts = group_artifacts(store, ref, args.job)
        if arts:
            label = f"group {ref}"
        else:
            art = store.get(ref)
            if art.kind == KIND:
                return f"analysis {art.id}", _load(art)
            arts = [art]
            label = f"trace {art.id}"
        data = analyse(_check_traces(arts), top=200, workers=args.workers or None, max_bytes=max_bytes)
        if not data["ranks"]:
            raise errors.DynprofError(
                f"no trace of {ref!r} could be analysed: " + "; ".join(e["error"] for e in data["errors"])
            )
        return label, data


def group_of(art: Artifact) -> str:
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


def _check_traces(arts: list[Artifact]) -> list[Artifact]:
    from collectors.torch_trace import TRACE_FILE

    bad = [a for a in arts if a.kind != "trace"]
    if bad:
        raise errors.UsageError(
            f"{bad[0].id} is a {bad[0].kind} artifact, not a trace",
            help="Give trace artifacts (`dynprof ls --kind trace`), or one analysis artifact to print it.",
        )
    missing = [a for a in arts if not a.has_file(TRACE_FILE)]
    if missing:
        raise errors.ArtifactError(f"{missing[0].id} has no {TRACE_FILE} ({missing[0].status})")
    # One trace per rank: with several of the same rank, the newest.
    by_rank: dict[Any, Artifact] = {}
    for a in sorted(arts, key=lambda a: a.created_at):
        key = (a.manifest.get("host"), a.manifest.get("rank"), a.manifest.get("pid"))
        by_rank[key] = a
    return list(by_rank.values())


def analyse(arts: list[Artifact], top: int, workers: int | None, max_bytes: int) -> dict[str, Any]:
    from collectors.torch_trace import TRACE_FILE
    from collectors.trace_analysis.job import combine
    from collectors.trace_analysis.rank import RankInput, analyze_ranks, device_of

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
    from collectors.trace_analysis.artifact import ANALYSIS_FILE, KIND

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


def _load(art: Artifact) -> dict[str, Any]:
    from collectors.trace_analysis.artifact import load_analysis
    from collectors.trace_analysis.reader import TraceError

    try:
        return load_analysis(art)
    except TraceError as exc:
        raise errors.ArtifactError(str(exc)) from None


class Analysis(Result):
    """One analysis: ``--json`` prints it with its tables cut to ``--top`` rows and the
    artifact it was saved as."""

    def __init__(
        self, args: argparse.Namespace, data: dict[str, Any], label: str, saved: Artifact | None, loaded: bool = False
    ) -> None:
        # with --json, the ranks not analysed are in the JSON; else they are said on stderr
        messages = (
            []
            if args.json
            else [
                printable(f"warning: rank {e.get('rank')} not analysed: {e['error']}") for e in data.get("errors") or []
            ]
        )
        super().__init__({}, 0, messages)
        self.data = data
        self.label = label
        self.saved = saved
        self.loaded = loaded
        self.top = args.top

    def to_json(self) -> dict[str, Any]:
        out = dict(self.data)
        out["top_kernels"] = out.get("top_kernels", [])[: self.top]
        out["top_ops"] = out.get("top_ops", [])[: self.top]
        out["artifact"] = self.saved.id if self.saved else None
        return out


class Comparison(Result):
    """``--compare A B``: B minus A, with what each side was."""

    def __init__(self, comparison: dict[str, Any], a_label: str, b_label: str) -> None:
        super().__init__({}, 0, [])
        self.comparison = comparison
        self.a_label = a_label
        self.b_label = b_label

    def to_json(self) -> dict[str, Any]:
        return {**self.comparison, "a": {"label": self.a_label}, "b": {"label": self.b_label}}
