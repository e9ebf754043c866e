"""`dynprof analyze`: where each rank's step time goes, and which rank holds the others back."""

from __future__ import annotations

import argparse

from collectors.trace_analysis.collect import Analysis, AnalysisRequest, Comparison, collect
from collectors.trace_analysis.render import render_compare_text, render_text
from dynprof.cli._common import add_json, bounded_int, printable, printable_lines
from dynprof.result import Result
from dynprof.store import ArtifactStore
from dynprof.units import parse_size
from dynprof.untrusted import max_trace_bytes


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
        request = request_from_args(args)
        result = collect(request, ArtifactStore())
        if args.json:
            result.messages = []  # the ranks not analysed are in the JSON's errors
        return result

    def render(self, result: Result) -> str:
        if isinstance(result, Comparison):
            return printable_lines(render_compare_text(result.comparison, result.a_label, result.b_label))
        assert isinstance(result, Analysis)
        data = result.data
        text = printable(f"analysis of {result.label}") + "\n" + printable_lines(render_text(data, top=result.top))
        if data.get("elapsed_s") is not None and not result.loaded:
            text += f"\n\nanalysed in {data['elapsed_s']:.2f} s"
            text += f"; saved as {result.saved.id}" if result.saved else ""
        return text


def request_from_args(args: argparse.Namespace) -> AnalysisRequest:
    """The options of `dynprof analyze` as the kind's request (``--max-trace-bytes`` read as a
    size, else ``DYNPROF_MAX_TRACE_BYTES``)."""
    return AnalysisRequest(
        artifacts=tuple(args.artifacts),
        job=args.job,
        group=args.group,
        compare=tuple(args.compare) if args.compare else None,
        top=args.top,
        workers=args.workers,
        max_bytes=parse_size(args.max_trace_bytes) if args.max_trace_bytes else max_trace_bytes(),
        save=not args.no_save,
    )
