"""Where each rank's step time goes, and which rank holds the others back: the ``analysis``
capture kind, in one package.

Reads the gzipped Chrome traces that :mod:`collectors.torch_trace` writes (one per rank), in a
streaming pass per file, and reduces each to per-step figures. Used by ``dynprof analyze`` and
the straggler watch; the web page renders the resulting ``analysis`` artifact with
:func:`.html.render_html`.

The modules, in the order the work flows:

:mod:`.reader`     a Chrome trace read safely, one event at a time (size and value caps, no
                   links): :func:`iter_trace`, :class:`TraceError`.
:mod:`.intervals`  interval arithmetic over time (:class:`Cover`: union, intersection,
                   difference, gaps, measure) and the typed arrays a trace's intervals are
                   kept in.
:mod:`.rank`       one rank's trace to its figures (:func:`analyze_rank`: the step breakdown,
                   top kernels and operators, a timeline), and every rank's in parallel
                   processes (:func:`analyze_ranks`).
:mod:`.job`        the job's judgement: ranks combined into the job-wide analysis
                   (:func:`combine`), the straggler rule (:func:`detect_straggler`), two
                   analyses compared (:func:`compare`).
:mod:`.artifact`   the ``analysis`` artifact: kind, file, schema, and its one reader
                   (:func:`load_analysis`).
:mod:`.render`     text: the analysis, a comparison, an artifact's summary for ``dynprof show``.
:mod:`.html`       HTML: the verdict and the SVG charts for the web page.
:mod:`.collect`    the kind's collection from the artifact store, whoever asks
                   (:class:`AnalysisRequest`, :func:`collect`: find the traces, analyse,
                   save; :func:`collect_comparison`); not imported here.

The names other packages use are here too.
"""

from collectors.trace_analysis.artifact import (
    ANALYSIS_FILE,
    KIND,
    MAX_ANALYSIS_FILE_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    load_analysis,
)
from collectors.trace_analysis.html import render_html
from collectors.trace_analysis.intervals import Cover
from collectors.trace_analysis.job import (
    COPY_BYTES_TOLERANCE,
    NOISE_FLOOR_MS,
    NOISE_FRACTION,
    WORK_COUNT_TOLERANCE,
    category_means,
    combine,
    compare,
    detect_straggler,
    short_collective,
    short_function,
)
from collectors.trace_analysis.rank import (
    CPU_CATEGORIES,
    GPU_CATEGORIES,
    MAX_DURATION_US,
    MAX_TIMESTAMP_US,
    TIMELINE_SEGMENTS,
    TIMELINE_STEPS,
    RankInput,
    analyze_rank,
    analyze_ranks,
    default_workers,
    device_of,
    is_comm_kernel,
    is_comm_op,
    profiler_step_number,
)
from collectors.trace_analysis.reader import DEFAULT_MAX_TRACE_BYTES, MAX_VALUE_CHARS, TraceError, iter_trace
from collectors.trace_analysis.render import render_artifact, render_compare_text, render_text

__all__ = [
    "ANALYSIS_FILE",
    "COPY_BYTES_TOLERANCE",
    "CPU_CATEGORIES",
    "DEFAULT_MAX_TRACE_BYTES",
    "GPU_CATEGORIES",
    "KIND",
    "MAX_ANALYSIS_FILE_BYTES",
    "MAX_DURATION_US",
    "MAX_TIMESTAMP_US",
    "MAX_VALUE_CHARS",
    "NOISE_FLOOR_MS",
    "NOISE_FRACTION",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TIMELINE_SEGMENTS",
    "TIMELINE_STEPS",
    "WORK_COUNT_TOLERANCE",
    "Cover",
    "RankInput",
    "TraceError",
    "analyze_rank",
    "analyze_ranks",
    "category_means",
    "combine",
    "compare",
    "default_workers",
    "detect_straggler",
    "device_of",
    "is_comm_kernel",
    "is_comm_op",
    "iter_trace",
    "load_analysis",
    "profiler_step_number",
    "render_artifact",
    "render_compare_text",
    "render_html",
    "render_text",
    "short_collective",
    "short_function",
]
