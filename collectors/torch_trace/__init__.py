"""torch.profiler trace capture, driven from the training thread at step boundaries.

:class:`TraceSession` wraps one ``torch.profiler.profile``: :meth:`start` and :meth:`step`
run on the training thread (torch.profiler records the operators of the thread that starts
it); :meth:`stop` ends profiling there too and returns quickly; :meth:`export` writes the
gzipped Chrome trace into an artifact and may run on another thread, so the training thread
is paused only for ``stop``. The artifact's manifest records that pause.

Readers: :func:`read_trace` and :func:`summarize` (used by ``dynprof show`` and the demo).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dynprof.safetext import one_line

if TYPE_CHECKING:
    from dynprof.registry import AgentRecord

TRACE_FILE = "trace.json.gz"
# torch writes the uncompressed trace here (in the artifact's temporary directory) and dynprof
# compresses it into TRACE_FILE; it is removed once compressed, or when the write is given up.
TRACE_UNCOMPRESSED_FILE = "trace.json.uncompressed"
# TraceState.last_artifact_status while the job exits and its trace is being written (then
# last_artifact is where the artifact will be).
WRITING_AT_EXIT = "writing-at-exit"
KIND = "trace"

# Kineto prints "USDT: ... profiler_start/stop" lines and, with a CUDA build on a machine
# without a GPU, device-probe errors into the process's stderr. Its one logger is process-wide:
# KINETO_LOG_LEVEL is read once, when Kineto first initialises (after that, changing the
# variable changes nothing), and USDT is its highest severity, so only level 6 hides those lines
# and it hides everything else too. dynprof never sets the variable (that would silence the
# job's own later profilers for good); it raises libkineto's severity threshold to this level
# only while its own profiler starts and stops, on the training thread, and restores it.
KINETO_QUIET_LEVEL = 6
_KINETO_SEVERITY_SYMBOL = "_ZN9libkineto6Logger14severityLevel_E"  # libkineto::Logger::severityLevel_
MAX_WARNINGS_KEPT = 20


# What torch.profiler records besides its activities: one switch each, named as its arguments
# (and as TraceOptions' fields, the trace request's, the wire's and the command line's).
SWITCHES = ("record_shapes", "with_stack", "profile_memory", "with_flops", "with_modules")


@dataclass
class TraceOptions:
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    with_flops: bool = False
    with_modules: bool = False
    activities: list[str] = field(default_factory=list)  # empty: cpu, plus cuda if initialised

    @classmethod
    def of(cls, source: Any) -> TraceOptions:
        """The options that ``source`` carries in fields of the same names (a trace request,
        the wire's ``TraceOptions``)."""
        return cls(**{key: getattr(source, key) for key in SWITCHES}, activities=list(source.activities))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def resolve_activities(names: list[str]) -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    if not names:
        names = ["cpu"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            names.append("cuda")
    table = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
    xpu = getattr(ProfilerActivity, "XPU", None)
    if xpu is not None:
        table["xpu"] = xpu
    out = []
    for name in names:
        if name not in table:
            raise ValueError(f"unknown activity {name!r}; choose from {', '.join(sorted(table))}")
        out.append(table[name])
    return out


class TraceSession:
    def __init__(self, options: TraceOptions, distributed_info: dict[str, Any]) -> None:
        self.options = options
        self.distributed_info = distributed_info
        self.prof: Any = None
        self.started_at = 0.0
        self.stopped_at = 0.0
        self.stop_requested_at = 0.0  # when the stop was due (it may wait for a safe point)
        self.first_step: int | None = None
        self.stop_pause_s = 0.0
        self.thread_id: int | None = None
        self.warnings: list[str] = []  # what torch warned about while dynprof drove the profiler

    @contextlib.contextmanager
    def _quiet(self) -> Any:
        """Keep torch's warnings about dynprof's own profiler out of the job's output.

        Only used on the training thread around start/stop, which take milliseconds; the
        warnings are kept for the manifest instead.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught[: max(0, MAX_WARNINGS_KEPT - len(self.warnings))]:
            self.warnings.append(f"{w.category.__name__}: {w.message}")

    def start(self, first_step: int | None) -> None:
        """Start profiling on the calling thread. ``first_step`` names the first ProfilerStep."""
        import threading

        import torch.profiler
        from torch.profiler import ProfilerAction

        o = self.options
        prof = torch.profiler.profile(
            activities=resolve_activities(o.activities),
            # A schedule that always records makes the profiler mark ProfilerStep#N spans.
            schedule=lambda step: ProfilerAction.RECORD,
            record_shapes=o.record_shapes,
            with_stack=o.with_stack,
            profile_memory=o.profile_memory,
            with_flops=o.with_flops,
            with_modules=o.with_modules,
        )
        if first_step is not None:
            prof.step_num = first_step
        self.first_step = first_step
        with self._quiet(), _KinetoQuiet() as kineto:
            _after_prepare(prof, kineto.again)
            prof.start()
        self.prof = prof
        self.thread_id = threading.get_ident()
        self.started_at = time.time()
        if not _dist_initialized():
            # torch adds distributedInfo itself when torch.distributed is initialised;
            # otherwise we describe this process so HTA and Perfetto accept the trace.
            try:
                prof.add_metadata_json("distributedInfo", json.dumps(self.distributed_info))
            except Exception:
                pass

    def step(self) -> None:
        self.prof.step()

    def stop(self) -> None:
        """Stop recording. ``stopped_at`` is when recording ended; the time torch then spends
        collecting the events on this thread is ``stop_pause_s``."""
        self.stopped_at = time.time()
        t0 = time.perf_counter()
        with self._quiet(), _KinetoQuiet():
            self.prof.stop()
        self.stop_pause_s = time.perf_counter() - t0

    def export(self, path: Path) -> dict[str, Any]:
        """Write the gzipped Chrome trace to ``path``; return manifest summary fields.

        Given a ``.gz`` name, torch writes the uncompressed trace to a temporary file of its own
        in ``$TMPDIR``, which a write cut off by the job's exit leaves behind. So dynprof asks
        torch for the uncompressed trace beside ``path`` (TRACE_UNCOMPRESSED_FILE, in the
        artifact's temporary directory) and compresses it itself, as torch does."""
        t0 = time.perf_counter()
        if path.name.endswith(".gz"):
            plain = path.with_name(TRACE_UNCOMPRESSED_FILE)
            try:
                self.prof.export_chrome_trace(str(plain))
                with open(plain, "rb") as fin, gzip.open(path, "wb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
            finally:
                with contextlib.suppress(OSError):
                    plain.unlink()
        else:
            self.prof.export_chrome_trace(str(path))
        export_s = time.perf_counter() - t0
        return {
            "trace_file": TRACE_FILE,
            "first_step": self.first_step,
            "profiled_from": self.started_at,
            "profiled_until": self.stopped_at,
            "profiled_s": round(self.stopped_at - self.started_at, 6),
            "training_thread_pause_ms": round(self.stop_pause_s * 1000, 3),
            "stop_waited_s": round(max(0.0, self.stopped_at - self.stop_requested_at), 6)
            if self.stop_requested_at
            else 0.0,
            "export_s": round(export_s, 3),
            "activities": self.options.activities,
            "trace_bytes": path.stat().st_size,
            "torch_warnings": list(self.warnings),
        }


class _KinetoQuiet:
    """Kineto's own lines hidden while dynprof's profiler starts or stops (see above)."""

    def __init__(self) -> None:
        self.level = _kineto_severity()
        self.before = 0
        self.quiet = KINETO_QUIET_LEVEL

    def __enter__(self) -> _KinetoQuiet:
        if self.level is not None:
            self.before = self.level.value
            self.quiet = max(self.before, KINETO_QUIET_LEVEL)
            self.level.value = self.quiet
        return self

    def again(self) -> None:
        """After Kineto's first initialisation (in the profiler's prepare step), which sets
        the level of its own (from the job's KINETO_LOG_LEVEL, or its default): that level is
        the one to restore, and dynprof's start stays quiet."""
        if self.level is not None and self.level.value != self.quiet:
            self.before = self.level.value
            self.level.value = self.quiet

    def __exit__(self, *exc: object) -> None:
        if self.level is None:
            return
        # A level that differs from the quiet one was set meanwhile by Kineto's own
        # initialisation, and stays; so does a quiet level the job itself asked for.
        if self.level.value == self.quiet and _env_kineto_level() != self.quiet:
            self.level.value = self.before


def _after_prepare(prof: Any, callback: Any) -> None:
    """Call ``callback`` right after ``prof``'s prepare step in its start (dynprof's own
    profiler object; its schedule always records). Nothing happens where torch lays this out
    differently."""
    try:
        from torch.profiler import ProfilerAction

        table: Any = getattr(prof, "action_map", None)
        key = (ProfilerAction.NONE, ProfilerAction.RECORD)
        actions = table.get(key) if isinstance(table, dict) else None
        if not actions or actions[0] != prof.prepare_trace:
            return
        prepare = actions[0]

        def prepare_then() -> None:
            prepare()
            callback()

        table[key] = [prepare_then, *actions[1:]]
    except Exception:
        pass


_KINETO_LEVEL: list[Any] = []  # [ctypes.c_int or None], found once


def _env_kineto_level() -> int | None:
    """KINETO_LOG_LEVEL as Kineto reads it (atoi), or None when unset."""
    text = os.environ.get("KINETO_LOG_LEVEL")
    if text is None:
        return None
    digits = text.strip()
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    n = 0
    for ch in digits:
        if not ch.isdigit():
            break
        n = n * 10 + int(ch)
    return sign * n


def _kineto_severity() -> Any:
    """libkineto's severity threshold (a ``ctypes.c_int`` over the process's own variable),
    or None when this torch build does not export it (then Kineto's lines are left as they are)."""
    if not _KINETO_LEVEL:
        found = None
        try:
            import ctypes

            import torch

            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            found = ctypes.c_int.in_dll(lib, _KINETO_SEVERITY_SYMBOL)
            if not 0 <= found.value <= 16:  # not what a severity looks like: leave it alone
                found = None
        except Exception:
            found = None
        _KINETO_LEVEL.append(found)
    return _KINETO_LEVEL[0]


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


# -- readers ---------------------------------------------------------------------------------
# Trace files are untrusted input: they are inflated as a stream with a cap on the uncompressed
# size (DYNPROF_MAX_TRACE_BYTES) and parsed one event at a time (dynprof.untrusted), so a small
# gzip bomb costs bounded memory and time.
_MAX_NAMES = 100_000  # distinct operator/kernel names tallied; the rest count as "(other names)"
_MAX_STEPS = 100_000


def iter_trace(fh: IO[bytes], what: str = "trace") -> Iterator[tuple[str, Any, bool]]:
    """``(key, value, False)`` for each top-level field of a Chrome trace, and
    ``("traceEvents", event, True)`` for each event, from a gzipped or plain file object."""
    from dynprof.untrusted import iter_decompressed, iter_json_document, max_trace_bytes

    chunks = iter_decompressed(fh, max_trace_bytes(), what)
    return iter_json_document(chunks, ("traceEvents",), what)


def read_trace(path: Path) -> dict[str, Any]:
    """A whole trace as a dict (memory grows with the trace; the size and shape limits apply)."""
    from dynprof.untrusted import open_in

    path = Path(path)
    data: dict[str, Any] = {}
    events: list[Any] = []
    with open_in(path.parent, path.name) as fh:
        for key, value, streamed in iter_trace(fh, str(path)):
            if streamed:
                events.append(value)
            else:
                data[key] = value
    if events or "traceEvents" not in data:
        data["traceEvents"] = events
    return data


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            return 0.0
        # Finite and within what a trace can hold (microseconds: about 3000 years): a crafted
        # 1e300 would otherwise print as a 300-digit number.
        return number if math.isfinite(number) and abs(number) <= 1e17 else 0.0
    return 0.0


class TraceSummary:
    """Tallies a trace's events one at a time (so a trace never has to be held whole)."""

    def __init__(self) -> None:
        self.events = 0
        self.steps: list[tuple[float, str, float]] = []
        self.distributed_info: Any = None
        self.cpu_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    @staticmethod
    def _tally(table: dict[str, list[float]], name: str, dur: float) -> None:
        if name not in table and len(table) >= _MAX_NAMES:
            name = "(other names)"
        row = table[name]
        row[0] += 1
        row[1] += dur

    def add(self, e: Any) -> None:
        if not isinstance(e, dict) or e.get("ph") != "X":
            return
        self.events += 1
        cat = str(e.get("cat", ""))
        name = str(e.get("name", ""))
        dur = _number(e.get("dur", 0))
        if cat in ("cpu_op", "Operator"):
            self._tally(self.cpu_ops, name, dur)
        elif cat == "kernel":
            self._tally(self.kernels, name, dur)
        # With CUDA activities the profiler also projects each step onto the GPU timeline
        # (category gpu_user_annotation); those copies are not steps of their own.
        if name.startswith("ProfilerStep#") and cat != "gpu_user_annotation" and len(self.steps) < _MAX_STEPS:
            self.steps.append((_number(e.get("ts", 0)), name, dur))

    def result(self, top: int = 10) -> dict[str, Any]:
        def top_of(table: dict[str, list[float]]) -> list[dict[str, Any]]:
            rows = sorted(table.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
            return [{"name": k, "count": int(v[0]), "total_us": round(v[1], 1)} for k, v in rows]

        steps = sorted(self.steps, key=lambda s: s[0])
        return {
            "events": self.events,
            "steps": [{"name": name, "dur_ms": round(dur / 1000, 3)} for _, name, dur in steps],
            "distributed_info": self.distributed_info,
            "cpu_ops": top_of(self.cpu_ops),
            "gpu_kernels": top_of(self.kernels),
            "gpu_kernel_count": int(sum(v[0] for v in self.kernels.values())),
        }


def summarize_file(fh: IO[bytes], what: str = "trace", top: int = 10) -> dict[str, Any]:
    """:func:`summarize` of a trace file, streamed: memory stays bounded whatever its size."""
    acc = TraceSummary()
    for key, value, streamed in iter_trace(fh, what):
        if streamed:
            acc.add(value)
        elif key == "distributedInfo":
            acc.distributed_info = value
    return acc.result(top)


def profiler_steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``ProfilerStep#N`` spans of the training thread, in order.

    With CUDA activities the profiler also projects each span onto the GPU timeline
    (category ``gpu_user_annotation``); those copies are not steps of their own.
    """
    return _spans_named(trace, "ProfilerStep#")


def _optimizer_steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``Optimizer.step#...`` ranges torch.optim records around each optimizer step."""
    return _spans_named(trace, "Optimizer.step#")


def _spans_named(trace: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """The complete events (ph X) whose name starts with ``prefix``, by start time; without the
    GPU-timeline copies that CUDA activities add (category ``gpu_user_annotation``)."""
    spans = [
        e
        for e in trace.get("traceEvents", [])
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and str(e.get("name", "")).startswith(prefix)
        and e.get("cat") != "gpu_user_annotation"
    ]
    spans.sort(key=lambda e: _number(e.get("ts", 0)))
    return spans


def check_step_spans(trace: dict[str, Any]) -> dict[str, Any]:
    """How exactly a trace's ``ProfilerStep#N`` spans hold training iterations.

    Returns the number of spans, the optimizer steps (``Optimizer.step#...`` ranges) that
    start in each span (on any thread: autograd's device threads run the optimizers stepped in
    a CUDA backward), and the optimizer steps that straddle a span boundary (start in one span,
    or before the first, and end after its end). A trace whose spans are each exactly one
    iteration has ``straddling == 0`` and the same number of optimizer steps in every span
    (``per_span``: one for a plain loop, N for N optimizers per iteration).
    """
    spans = profiler_steps(trace)
    edges = [(_number(e.get("ts", 0)), _number(e.get("ts", 0)) + _number(e.get("dur", 0))) for e in spans]
    per_span = [0] * len(spans)
    straddling = 0
    outside = 0
    for e in _optimizer_steps(trace):
        start = _number(e.get("ts", 0))
        end = start + _number(e.get("dur", 0))
        inside = [i for i, (a, b) in enumerate(edges) if a <= start < b]
        if inside:
            i = inside[0]
            per_span[i] += 1
            if end > edges[i][1]:
                straddling += 1
        elif edges and start < edges[0][0] < end:
            straddling += 1  # began before the first span and ends inside the trace
        else:
            outside += 1
    return {
        "spans": len(spans),
        "names": [str(e.get("name", "")) for e in spans],
        "per_span": per_span,
        "straddling": straddling,
        "outside": outside,
        "one_each": bool(spans) and straddling == 0 and len(set(per_span)) == 1 and per_span[0] > 0,
    }


def summarize(trace: dict[str, Any], top: int = 10) -> dict[str, Any]:
    acc = TraceSummary()
    events = trace.get("traceEvents", [])
    for e in events if isinstance(events, list) else []:
        acc.add(e)
    acc.distributed_info = trace.get("distributedInfo")
    return acc.result(top)


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of a trace artifact, for `dynprof show` and the demo."""
    manifest_summary = artifact.manifest.get("summary") or {}
    with artifact.open(TRACE_FILE) as fh:  # only the artifact's own file, never through a link
        summary = summarize_file(fh, str(artifact.file(TRACE_FILE)))
    lines = []
    steps = summary["steps"]
    step_text = ", ".join(f"{s['name'].split('#')[1]} ({s['dur_ms']:.1f} ms)" for s in steps[:8])
    lines.append(f"{len(steps)} profiler steps: {step_text}{' ...' if len(steps) > 8 else ''}")
    lines.append(
        f"{summary['events']} events; training thread paused {manifest_summary.get('training_thread_pause_ms', '?')} ms "
        f"to stop the profiler; export took {manifest_summary.get('export_s', '?')} s off the training thread"
    )
    if summary.get("distributed_info"):
        lines.append(f"distributedInfo: {summary['distributed_info']}")
    if summary["cpu_ops"]:
        lines.append("")
        lines.append(f"{'top CPU operators':<48} {'calls':>7} {'total ms':>10}")
        for row in summary["cpu_ops"]:
            lines.append(f"{row['name'][:48]:<48} {row['count']:>7} {row['total_us'] / 1000:>10.3f}")
    if summary["gpu_kernels"]:
        lines.append("")
        lines.append(f"{'top GPU kernels':<48} {'calls':>7} {'total ms':>10}")
        for row in summary["gpu_kernels"]:
            lines.append(f"{row['name'][:48]:<48} {row['count']:>7} {row['total_us'] / 1000:>10.3f}")
    return summary, "\n".join(one_line(line) for line in lines)


# -- a request's trace, as the store holds it (what `dynprof start` and `stop` read back) --
def target_row(record: AgentRecord, start_step: int) -> dict[str, Any]:
    """A process's row of a trace request's ``targets`` and ``results``."""
    return {"pid": record.pid, "rank": record.rank, "job": record.job_id, "start_step": start_step}


def result_from_store(record: AgentRecord, group_id: str, at_step: int) -> dict[str, Any] | None:
    """The trace artifact this request's group left for ``record``'s process, if any."""
    try:
        from dynprof.store import ArtifactStore

        found = [
            a
            for a in ArtifactStore().list(kind="trace")
            if a.manifest.get("pid") == record.pid and (a.manifest.get("options") or {}).get("group_id") == group_id
        ]
    except Exception:
        return None
    if not found:
        return None
    art = found[0]  # newest first
    summary = art.manifest.get("summary") or {}
    return {
        **target_row(record, int(summary.get("start_step") or at_step)),
        "status": art.status,
        "artifact": str(art.path),
        "error": art.manifest.get("error")
        or (f"the process exited; stopped by {summary.get('stopped_by')}" if art.status != "complete" else None),
    }
