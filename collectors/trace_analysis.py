"""Where each rank's step time goes, and which rank holds the others back.

Reads the gzipped Chrome traces that :mod:`collectors.torch_trace` writes (one per rank), in a
streaming pass per file, and reduces each to per-step figures. Used by ``dynprof analyze``; the
web page renders the resulting ``analysis`` artifact with :func:`render_html`.

Reading
    :func:`iter_trace` parses the top-level JSON object incrementally and yields the events of
    ``traceEvents`` one at a time (stdlib ``json`` scanner over a sliding text buffer), so the
    event list is never held. It refuses a file whose decompressed size exceeds
    ``max_bytes`` (default :data:`DEFAULT_MAX_TRACE_BYTES`, 2 GiB) and a single JSON value
    larger than :data:`MAX_VALUE_CHARS` (64 Mi characters). What the analysis keeps per event
    is a few numbers in typed arrays (about 30 bytes per interval), not the event.

Breakdown of a step (the ``ProfilerStep#N`` span of the training thread, ``[start, end)``)
    Both breakdowns are exclusive categories over the same window, so each adds up to the
    step time exactly (up to float rounding):

    CPU (training thread)
        ``collective``       inside a collective operator (``c10d::*``, ``record_param_comms``,
                             ``nccl:*``, ``gloo:*``, functional collectives and their waits)
        ``ops``              inside any other operator or CUDA runtime call, not a collective
        ``collective_wait``  outside operators while a collective runs on another thread
                             (gloo's worker threads run ``gloo:*``): after a collective
                             operator, any; elsewhere, those already running when the gap
                             began (DDP's wait at the end of backward)
        ``outside_ops``      everything else: Python, data loading, sleeps
    GPU (all streams of the rank together; absent in CPU-only traces)
        ``compute``          a compute kernel runs, no communication kernel
        ``comm_overlap``     a compute and a communication kernel run at once
        ``comm``             a communication kernel runs (``nccl*``, ...), no compute kernel
        ``memcpy``           only memory copies / sets run
        ``idle``             nothing runs on the GPU
    GPU work is assigned to the CPU step window in which it runs, not the one that launched it.

Straggler
    Per rank and step, ``collective_ms`` is the time spent waiting in collectives (GPU traces:
    GPU ``comm``; CPU-only traces: CPU ``collective + collective_wait``) and ``work_ms`` the
    rest of the step. The rank with the most work (mean over the common steps) is the
    straggler when its work exceeds the median of the other ranks' by more than the noise
    threshold (``max(NOISE_FLOOR_MS, NOISE_FRACTION x median step time)``), it is the slowest
    rank in at least half of the steps, and the others spend at least half that excess more
    than it waiting in collectives. docs/analyze.md has the details.
"""

from __future__ import annotations

import bisect
import codecs
import gzip
import json
import json.scanner
import math
import os
import re
import statistics
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dynprof.errors import ArtifactError
from dynprof.safetext import one_line

KIND = "analysis"
ANALYSIS_FILE = "analysis.json"
SCHEMA = "dynprof.analysis"
SCHEMA_VERSION = 1
DEFAULT_MAX_TRACE_BYTES = 2 * 1024**3
MAX_VALUE_CHARS = 64 * 1024**2
NOISE_FLOOR_MS = 2.0
NOISE_FRACTION = 0.10
TIMELINE_SEGMENTS = 400  # per lane and step, after merging segments shorter than a pixel
TIMELINE_STEPS = 64
_CHUNK = 1 << 20
# Event times a real trace can hold, in microseconds: Kineto's timestamps are since the Unix
# epoch (about 1.8e15 now) or since the process started; no span lasts longer than dynprof's
# one-day cap on a trace. Events outside these (NaN, infinities, 1e300 from a crafted file) are
# skipped at read, so that no total, table or JSON number is absurd or non-finite.
MAX_TIMESTAMP_US = 1e17  # about 3000 years
MAX_DURATION_US = 1e11  # about 28 hours

CPU_CATEGORIES = ("ops", "collective", "collective_wait", "outside_ops")
GPU_CATEGORIES = ("compute", "comm_overlap", "comm", "memcpy", "idle")

_COMM_OP = re.compile(
    r"^(c10d::|c10d_functional::|_c10d_functional::|record_param_comms|nccl:|gloo:|ProcessGroup|"
    r"torch\.distributed\.|mpi:|ucc:)",
    re.IGNORECASE,
)
_COMM_KERNEL = re.compile(
    r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce|nvshmem",
    re.IGNORECASE,
)
_OP_CATS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "operator", "Operator"})
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"})
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*(?:,[ \t\n\r]*)?")


class TraceError(Exception):
    """A trace file that cannot be analysed (too large, not JSON, not a Chrome trace)."""


# -- streaming reader ---------------------------------------------------------------------------
class _Text:
    """A sliding window of decoded text over a (gzipped) byte stream, with a size cap."""

    def __init__(self, fh: IO[bytes], max_bytes: int, name: str) -> None:
        self.fh = fh
        self.max_bytes = max_bytes
        self.name = name
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.total = 0
        self.eof = False

    def more(self, need: int = _CHUNK) -> bool:
        """Append at least ``need`` bytes of input (fewer at the end); False at end of input."""
        if self.eof:
            return False
        if self.pos:
            self.buf = self.buf[self.pos :]
            self.pos = 0
        if len(self.buf) > MAX_VALUE_CHARS:
            raise TraceError(f"{self.name}: a JSON value longer than {MAX_VALUE_CHARS} characters")
        try:
            data = self.fh.read(max(need, _CHUNK))
        except (OSError, EOFError, gzip.BadGzipFile, ArtifactError) as exc:
            raise TraceError(f"{self.name}: cannot read: {exc}") from None
        if not data:
            self.eof = True
            self.buf += self.decoder.decode(b"", final=True)
            return False
        self.total += len(data)
        if self.total > self.max_bytes:
            raise TraceError(
                f"{self.name}: more than {self.max_bytes} bytes once decompressed; refusing to read it "
                "(raise the limit with --max-trace-bytes)"
            )
        try:
            self.buf += self.decoder.decode(data)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{self.name}: not UTF-8 text: {exc}") from None
        return True

    def skip_ws(self) -> str:
        """Skip whitespace; return the next character ('' at end of input)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def value(self, scan: Callable[[str, int], tuple[Any, int]]) -> Any:
        """Decode one JSON value at the cursor, reading more input until it is complete."""
        while True:
            try:
                obj, end = scan(self.buf, self.pos)
            except (StopIteration, json.JSONDecodeError, ValueError) as exc:
                if self.more(len(self.buf)):
                    continue
                raise TraceError(f"{self.name}: truncated or not valid JSON (at byte {self.total}): {exc}") from None
            except RecursionError:
                raise TraceError(f"{self.name}: JSON nested too deeply") from None
            # A number at the very end of the buffer may continue in the next chunk.
            if end >= len(self.buf) and not self.eof and self.more():
                continue
            self.pos = end
            return obj


def iter_trace(
    path: Path | str, header: dict[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_TRACE_BYTES
) -> Iterator[dict[str, Any]]:
    """Yield the events of a Chrome trace one by one; top-level keys other than
    ``traceEvents`` go into ``header`` (those after the event array only once it is exhausted)."""
    header = {} if header is None else header
    from dynprof.untrusted import DecompressedReader, open_in

    scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
    path = Path(path)
    try:
        raw = open_in(path.parent, path.name)  # a regular file, never through a link
    except ArtifactError as exc:
        raise TraceError(str(exc)) from None
    # Gunzipped with the size cap a chunk above ours (ours says it first) and the ratio cap.
    gunzip = DecompressedReader(raw, max_bytes + _CHUNK, str(path)) if path.name.endswith(".gz") else None
    with raw, gunzip or raw as fh:
        text = _Text(fh, max_bytes, str(path))  # type: ignore[arg-type]
        if text.skip_ws() != "{":
            raise TraceError(f"{path}: not a Chrome trace (no JSON object)")
        text.pos += 1
        while True:
            c = text.skip_ws()
            if c == "}":
                return
            if c == ",":
                text.pos += 1
                continue
            if c != '"':
                raise TraceError(f"{path}: not valid JSON (expected a key)")
            key = text.value(scan)
            if text.skip_ws() != ":":
                raise TraceError(f"{path}: not valid JSON (expected ':')")
            text.pos += 1
            if key != "traceEvents":
                text.skip_ws()
                header[key] = text.value(scan)
                continue
            if text.skip_ws() != "[":
                raise TraceError(f"{path}: traceEvents is not a list")
            text.pos += 1
            while True:
                # Fast path: decode events back to back while the buffer holds whole ones.
                buf = text.buf
                pos = _SEP.match(buf, text.pos).end()  # type: ignore[union-attr]
                limit = len(buf)
                try:
                    while True:
                        event, end = scan(buf, pos)
                        pos = _SEP.match(buf, end).end()  # type: ignore[union-attr]
                        if pos >= limit:
                            text.pos = end
                            if isinstance(event, dict):
                                yield event
                            break
                        if isinstance(event, dict):
                            yield event
                except (StopIteration, ValueError):
                    text.pos = pos
                except RecursionError:
                    raise TraceError(f"{path}: JSON nested too deeply") from None
                c = text.skip_ws()
                if c == "]":
                    text.pos += 1
                    break
                if c == ",":
                    text.pos += 1
                    continue
                if c == "":
                    raise TraceError(f"{path}: truncated (traceEvents never ends)")
                event = text.value(scan)
                if isinstance(event, dict):
                    yield event


# -- interval arithmetic ------------------------------------------------------------------------
class Cover:
    """A union of intervals: sorted, disjoint ``[start, end)`` with prefix lengths for O(log n)
    measures of how much of a window it covers."""

    __slots__ = ("cum", "ends", "starts")

    def __init__(self, starts: Sequence[float], ends: Sequence[float]) -> None:
        self.starts = array("d", starts)
        self.ends = array("d", ends)
        cum = array("d", [0.0])
        total = 0.0
        for s, e in zip(starts, ends):
            total += e - s
            cum.append(total)
        self.cum = cum

    @classmethod
    def union(cls, starts: Sequence[float], ends: Sequence[float]) -> Cover:
        order = sorted(range(len(starts)), key=starts.__getitem__)
        out_s: list[float] = []
        out_e: list[float] = []
        for i in order:
            s, e = starts[i], ends[i]
            if e <= s:
                continue
            if out_e and s <= out_e[-1]:
                if e > out_e[-1]:
                    out_e[-1] = e
            else:
                out_s.append(s)
                out_e.append(e)
        return cls(out_s, out_e)

    def __len__(self) -> int:
        return len(self.starts)

    def measure(self, a: float, b: float) -> float:
        """Length of this cover inside ``[a, b)``."""
        if b <= a or not self.starts:
            return 0.0
        i = bisect.bisect_right(self.ends, a)
        j = bisect.bisect_left(self.starts, b)
        if i >= j:
            return 0.0
        total = self.cum[j] - self.cum[i]
        if self.starts[i] < a:
            total -= a - self.starts[i]
        if self.ends[j - 1] > b:
            total -= self.ends[j - 1] - b
        return total

    def intersect(self, other: Cover) -> Cover:
        out_s: list[float] = []
        out_e: list[float] = []
        i = j = 0
        while i < len(self.starts) and j < len(other.starts):
            s = max(self.starts[i], other.starts[j])
            e = min(self.ends[i], other.ends[j])
            if s < e:
                out_s.append(s)
                out_e.append(e)
            if self.ends[i] < other.ends[j]:
                i += 1
            else:
                j += 1
        return Cover(out_s, out_e)

    def plus(self, other: Cover) -> Cover:
        return Cover.union(list(self.starts) + list(other.starts), list(self.ends) + list(other.ends))

    def segments(self, a: float, b: float) -> Iterator[tuple[float, float]]:
        i = bisect.bisect_right(self.ends, a)
        while i < len(self.starts) and self.starts[i] < b:
            yield max(self.starts[i], a), min(self.ends[i], b)
            i += 1


class _Spans:
    """Intervals of one thread or device, kept as typed arrays: start, end, name id, flag."""

    __slots__ = ("ends", "flags", "names", "starts")

    def __init__(self) -> None:
        self.starts = array("d")
        self.ends = array("d")
        self.names = array("l")
        self.flags = array("b")

    def add(self, start: float, end: float, name: int, flag: int) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.names.append(name)
        self.flags.append(flag)

    def __len__(self) -> int:
        return len(self.starts)

    def cover(self, keep: Callable[[int], bool] | None = None) -> Cover:
        if keep is None:
            return Cover.union(self.starts, self.ends)
        idx = [i for i in range(len(self.starts)) if keep(self.flags[i])]
        return Cover.union([self.starts[i] for i in idx], [self.ends[i] for i in idx])


# Span flags.
_OP, _COLL, _PY = 0, 1, 2
_COMPUTE, _COMM, _MEM = 0, 1, 2
# What an event is for the analysis.
_W_SKIP, _W_GPU, _W_THREAD, _W_STEP = 0, 1, 2, 3


def is_comm_op(name: str) -> bool:
    return bool(_COMM_OP.match(name))


def is_comm_kernel(name: str) -> bool:
    return bool(_COMM_KERNEL.search(name))


# -- one rank -----------------------------------------------------------------------------------
@dataclass
class RankInput:
    path: str
    rank: int | None = None
    host: str | None = None
    artifact: str | None = None
    max_bytes: int = DEFAULT_MAX_TRACE_BYTES
    # the physical GPU the rank ran on (its UUID, from the trace's manifest): ranks that share
    # one contend on it, so their GPU-side times differ for no fault of either
    device: str | None = None


_STEP_NAME = re.compile(r"ProfilerStep#([0-9]{1,18})")


def profiler_step_number(name: str) -> int | None:
    """The iteration a ``ProfilerStep#N`` span names: N in ASCII digits, not negative (the
    profiler counts from 0); None for any other name (``#-1``, ``#١٢``, ``# 3``, ``#1_0``,
    which ``int()`` would take)."""
    found = _STEP_NAME.fullmatch(name)
    return int(found.group(1)) if found else None


def analyze_rank(item: RankInput) -> dict[str, Any]:
    """Reduce one rank's trace to per-step figures, top kernels and ops, and a timeline."""
    path = Path(item.path)
    header: dict[str, Any] = {}
    names: dict[str, int] = {}
    name_list: list[str] = []

    def nid(name: str) -> int:
        i = names.get(name)
        if i is None:
            i = names[name] = len(name_list)
            name_list.append(name)
        return i

    threads: dict[tuple[Any, Any], _Spans] = {}
    gpu = _Spans()
    steps: list[tuple[int, float, float, Any]] = []
    copies: list[tuple[float, int]] = []  # (start, bytes) of each GPU memory copy or set
    launched: list[tuple[float, int]] = []  # (start, threads: grid x block) of each kernel
    events = 0
    # (cat, name) -> (what, name id, flag): classified once per distinct pair.
    memo: dict[tuple[Any, str], tuple[int, int, int]] = {}

    def classify(cat: Any, name: str) -> tuple[int, int, int]:
        if cat in _GPU_CATS:
            if cat in ("kernel", "Kernel"):
                return _W_GPU, nid(name), _COMM if is_comm_kernel(name) else _COMPUTE
            return _W_GPU, nid(name), _MEM
        if name.startswith("ProfilerStep#") and cat != "gpu_user_annotation":
            step = profiler_step_number(name)
            return (_W_STEP, step, 0) if step is not None else (_W_SKIP, 0, 0)
        if cat in _OP_CATS:
            return _W_THREAD, nid(name), _COLL if is_comm_op(name) else _OP
        if cat == "python_function":
            return _W_THREAD, nid(name), _PY
        return _W_SKIP, 0, 0

    for e in iter_trace(path, header, item.max_bytes):
        events += 1
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        name = e.get("name")
        if not isinstance(name, str):
            name = str(name)
        try:
            what, ident, flag = memo[(cat, name)]
        except KeyError:
            what, ident, flag = memo[(cat, name)] = classify(cat, name)
        except TypeError:  # an unhashable category
            continue
        if what == _W_SKIP:
            continue
        try:
            ts = float(e["ts"])
            dur = float(e["dur"])
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: a 400-digit integer
            continue
        if not (0 <= dur <= MAX_DURATION_US and -MAX_TIMESTAMP_US <= ts <= MAX_TIMESTAMP_US):  # False for NaN
            continue
        if what == _W_GPU:
            gpu.add(ts, ts + dur, ident, flag)
            if flag == _MEM:
                copies.append((ts, _copy_bytes(e.get("args"))))
            else:
                launched.append((ts, _threads(e.get("args"))))
        elif what == _W_THREAD:
            key = (_lane_id(e.get("pid")), _lane_id(e.get("tid")))
            spans = threads.get(key)
            if spans is None:
                spans = threads[key] = _Spans()
            spans.add(ts, ts + dur, ident, flag)
        else:
            steps.append((ident, ts, ts + dur, (_lane_id(e.get("pid")), _lane_id(e.get("tid")))))
    if not steps:
        raise TraceError(f"{path}: no ProfilerStep spans (trace with `dynprof start --steps N`)")
    steps.sort(key=lambda s: s[1])
    # The training thread is the one holding the ProfilerStep spans (the most of them).
    counts: dict[Any, int] = defaultdict(int)
    for s in steps:
        counts[s[3]] += 1
    train_key = max(counts, key=counts.__getitem__)
    steps = [s for s in steps if s[3] == train_key]
    train = threads.get(train_key, _Spans())

    # CPU covers.
    # With CUDA tensors, backward runs on the autograd engine's device threads while the
    # training thread waits for it: their operators count as the training loop's.
    backward = [
        k
        for k, t in threads.items()
        if k != train_key
        and k[0] == train_key[0]
        and any(name_list[n].startswith("autograd::engine::evaluate_function") for n in set(t.names))
    ]
    loop = [train, *(threads[k] for k in backward)]
    ops = _cover_of(loop, lambda f: f != _PY)
    coll = _cover_of(loop, lambda f: f == _COLL)
    other_comm = [t.cover(lambda f: f == _COLL) for k, t in threads.items() if k != train_key and k not in backward]
    comm_elsewhere = Cover([], [])
    for c in other_comm:
        comm_elsewhere = comm_elsewhere.plus(c) if len(comm_elsewhere) else c
    wait = _collective_waits(ops, coll, comm_elsewhere)
    # GPU covers.
    has_gpu = len(gpu) > 0
    g_comp = gpu.cover(lambda f: f == _COMPUTE)
    g_comm = gpu.cover(lambda f: f == _COMM)
    g_mem = gpu.cover(lambda f: f == _MEM)
    g_both = g_comp.intersect(g_comm)
    g_kern = g_comp.plus(g_comm)
    g_mem_k = g_mem.intersect(g_kern)
    g_all = g_kern.plus(g_mem)

    step_rows = []
    for number, a, b, _ in steps:
        window = b - a
        c_coll = coll.measure(a, b)
        c_ops = ops.measure(a, b) - c_coll
        c_wait = wait.measure(a, b)
        cpu = {
            "ops": c_ops,
            "collective": c_coll,
            "collective_wait": c_wait,
            "outside_ops": max(0.0, window - c_ops - c_coll - c_wait),
        }
        row: dict[str, Any] = {
            "step": number,
            "start_us": a,
            "step_ms": window / 1000,
            "cpu": {k: v / 1000 for k, v in cpu.items()},
        }
        if has_gpu:
            both = g_both.measure(a, b)
            gpu_row = {
                "compute": g_comp.measure(a, b) - both,
                "comm_overlap": both,
                "comm": g_comm.measure(a, b) - both,
                "memcpy": g_mem.measure(a, b) - g_mem_k.measure(a, b),
                "idle": max(0.0, window - g_all.measure(a, b)),
            }
            row["gpu"] = {k: v / 1000 for k, v in gpu_row.items()}
            # Waiting for the peers: in NCCL kernels (GPU comm alone) or, where the collectives
            # run on the CPU (gloo over tensors copied from the GPU), in the CPU collective.
            row["collective_ms"] = max(row["gpu"]["comm"], (c_coll + c_wait) / 1000)
        else:
            row["gpu"] = None
            row["collective_ms"] = (c_coll + c_wait) / 1000
        row["work_ms"] = row["step_ms"] - row["collective_ms"]
        step_rows.append(row)

    first, last = steps[0][1], steps[-1][2]
    kernels: dict[str, list[float]] = {}
    for i in range(len(gpu)):
        if gpu.flags[i] != _MEM and first <= gpu.starts[i] < last:
            k = kernels.setdefault(name_list[gpu.names[i]], [0, 0.0])
            k[0] += 1
            k[1] += (gpu.ends[i] - gpu.starts[i]) / 1000
    in_steps = [b for ts, b in copies if first <= ts < last]
    threads_in_steps = sum(n for ts, n in launched if first <= ts < last)
    outside = _outside(ops, wait, first, last)
    python = _python_outside(train, outside, name_list, steps)
    top_ops = _self_times(threads, name_list, first, last)
    collectives = _collective_names(train, wait, name_list, g_comm, gpu, first, last, has_gpu)
    timeline = _timeline(steps[:TIMELINE_STEPS], ops, coll, wait, g_comp, g_comm, g_mem, has_gpu)
    raw_info = header.get("distributedInfo")
    info: dict[str, Any] = raw_info if isinstance(raw_info, dict) else {}
    rank = item.rank if item.rank is not None else info.get("rank")
    return {
        "rank": rank,
        "host": item.host or header.get("host_name"),
        "artifact": item.artifact,
        "path": str(path),
        "world_size": info.get("world_size"),
        "backend": info.get("backend"),
        "events": events,
        "has_gpu": has_gpu,
        "steps": step_rows,
        "kernels": {name: (int(v[0]), v[1]) for name, v in kernels.items()},
        "copies": {"count": len(in_steps), "bytes": sum(in_steps)},
        "kernel_threads": threads_in_steps,
        "device": item.device if isinstance(item.device, str) and item.device else None,
        "ops": top_ops,
        "python_outside": python,
        "collectives": collectives,
        "timeline": timeline,
    }


def device_of(manifest: Any) -> str | None:
    """The physical GPU a trace's manifest says its rank ran on (``gpu_device.uuid``: printable,
    at most 100 characters), or None; nothing in a manifest is trusted."""
    dev = manifest.get("gpu_device") if isinstance(manifest, dict) else None
    uuid = dev.get("uuid") if isinstance(dev, dict) else None
    if isinstance(uuid, str) and 0 < len(uuid) <= 100 and uuid.isprintable():
        return uuid
    return None


def _copy_bytes(args: Any) -> int:
    """The bytes a GPU memory copy or set event says it moved (Kineto's ``args.bytes``); 0 where
    it says nothing a number can be made of."""
    if not isinstance(args, dict):
        return 0
    v = args.get("bytes")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 << 50:
        return 0  # NaN fails the range test too
    return int(v)


def _threads(args: Any) -> int:
    """The threads a kernel event says it launched (``args.grid`` x ``args.block``, three counts
    each, as Kineto writes them); 0 where it does not say."""
    if not isinstance(args, dict):
        return 0
    n = 1
    for key in ("grid", "block"):
        dims = args.get(key)
        if not isinstance(dims, list) or len(dims) != 3:
            return 0
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 < d < 1 << 32:
                return 0
            n *= d
    return n


def _lane_id(value: Any) -> Any:
    """A pid or tid as a dictionary key: numbers and strings as they are (Kineto writes both),
    anything else (a list or object in a crafted trace) as its bounded text."""
    if value is None or isinstance(value, (int, float, str)):
        return value
    return repr(value)[:100]


def _cover_of(spans: list[_Spans], keep: Callable[[int], bool]) -> Cover:
    starts: list[float] = []
    ends: list[float] = []
    for t in spans:
        for i in range(len(t)):
            if keep(t.flags[i]):
                starts.append(t.starts[i])
                ends.append(t.ends[i])
    return Cover.union(starts, ends)


def _collective_waits(ops: Cover, coll: Cover, comm_elsewhere: Cover) -> Cover:
    """Where the training thread sits between operators waiting for a collective that runs on
    another thread (gloo runs ``gloo:*`` on its worker threads; ``work.wait()`` records no
    operator). A gap right after a collective operator waits for whatever collective runs
    during it; any other gap (DDP's wait at the end of backward) only for the collectives
    already running when the gap began."""
    if not len(comm_elsewhere):
        return Cover([], [])
    out_s: list[float] = []
    out_e: list[float] = []
    for i in range(len(ops.starts) - 1):
        gap_a, gap_b = ops.ends[i], ops.starts[i + 1]
        # Does a collective operator end where this busy stretch ends?
        j = bisect.bisect_left(coll.ends, gap_a - 1e-3)
        after_collective = j < len(coll.ends) and abs(coll.ends[j] - gap_a) <= 1e-3
        k = bisect.bisect_right(comm_elsewhere.ends, gap_a)
        while k < len(comm_elsewhere) and comm_elsewhere.starts[k] < gap_b:
            s, e = comm_elsewhere.starts[k], comm_elsewhere.ends[k]
            if after_collective or s <= gap_a + 1e-3:
                out_s.append(max(s, gap_a))
                out_e.append(min(e, gap_b))
            k += 1
    return Cover(out_s, out_e)


def _outside(ops: Cover, wait: Cover, a: float, b: float) -> Cover:
    """The gaps between operators in ``[a, b)``, less the collective waits."""
    starts: list[float] = []
    ends: list[float] = []
    cursor = a
    for s, e in ops.segments(a, b):
        if s > cursor:
            starts.append(cursor)
            ends.append(s)
        cursor = max(cursor, e)
    if cursor < b:
        starts.append(cursor)
        ends.append(b)
    if not len(wait):
        return Cover(starts, ends)
    gaps = Cover(starts, ends)
    common = gaps.intersect(wait)
    out_s: list[float] = []
    out_e: list[float] = []
    for s, e in zip(gaps.starts, gaps.ends):
        cursor = s
        for ws, we in common.segments(s, e):
            if ws > cursor:
                out_s.append(cursor)
                out_e.append(ws)
            cursor = we
        if cursor < e:
            out_s.append(cursor)
            out_e.append(e)
    return Cover(out_s, out_e)


def _python_outside(
    train: _Spans, outside: Cover, name_list: list[str], steps: list[tuple[int, float, float, Any]]
) -> dict[str, list[float]]:
    """Per Python function (``with_stack`` traces): time outside operators inside its frames,
    and its frames' total duration and count; frames spanning a step boundary are left out."""
    out: dict[str, list[float]] = {}
    starts = [s[1] for s in steps]
    for i in range(len(train)):
        if train.flags[i] != _PY:
            continue
        a, b = train.starts[i], train.ends[i]
        k = bisect.bisect_right(starts, a) - 1
        if k < 0 or b > steps[k][2] + 1e-3:
            continue
        name = name_list[train.names[i]]
        if name.startswith("<built-in"):
            continue
        t = outside.measure(a, b)
        if t <= 0:
            continue
        row = out.setdefault(name, [0.0, 0.0, 0])
        row[0] += t / 1000
        row[1] += (b - a) / 1000
        row[2] += 1
    # Keep the output small: the frames with the most time outside operators.
    keep = sorted(out.items(), key=lambda kv: kv[1][0], reverse=True)[:50]
    return dict(keep)


def _self_times(threads: dict[Any, _Spans], name_list: list[str], a: float, b: float) -> dict[str, list[float]]:
    """Per CPU operator name: [count, self ms, total ms] within the steps, over all threads."""
    out: dict[int, list[float]] = {}
    for spans in threads.values():
        idx = [i for i in range(len(spans)) if spans.flags[i] != _PY and a <= spans.starts[i] < b]
        idx.sort(key=lambda i: (spans.starts[i], -spans.ends[i]))
        stack: list[int] = []
        child: dict[int, float] = {}
        for i in idx:
            while stack and spans.ends[stack[-1]] <= spans.starts[i]:
                stack.pop()
            dur = spans.ends[i] - spans.starts[i]
            if stack:
                child[stack[-1]] = child.get(stack[-1], 0.0) + dur
            stack.append(i)
        for i in idx:
            dur = spans.ends[i] - spans.starts[i]
            row = out.setdefault(spans.names[i], [0, 0.0, 0.0])
            row[0] += 1
            row[1] += max(0.0, dur - child.get(i, 0.0)) / 1000
            row[2] += dur / 1000
    keep = sorted(out.items(), key=lambda kv: kv[1][1], reverse=True)[:100]
    return {name_list[k]: v for k, v in keep}


def _collective_names(
    train: _Spans,
    wait: Cover,
    name_list: list[str],
    g_comm: Cover,
    gpu: _Spans,
    a: float,
    b: float,
    has_gpu: bool,
) -> dict[str, float]:
    """Time per collective name: GPU comm kernels (not overlapped time is not separated), or
    the training thread's collective operators plus the waits that follow each."""
    out: dict[str, float] = defaultdict(float)
    if has_gpu:
        for i in range(len(gpu)):
            if gpu.flags[i] == _COMM and a <= gpu.starts[i] < b:
                out[name_list[gpu.names[i]]] += (gpu.ends[i] - gpu.starts[i]) / 1000
        return dict(out)
    colls = [i for i in range(len(train)) if train.flags[i] == _COLL and a <= train.starts[i] < b]
    colls.sort(key=lambda i: train.starts[i])
    top_end = -math.inf
    for n, i in enumerate(colls):
        s, e = train.starts[i], train.ends[i]
        if s < top_end:  # nested in another collective operator
            continue
        top_end = e
        nxt = train.starts[colls[n + 1]] if n + 1 < len(colls) else b
        out[name_list[train.names[i]]] += (e - s + wait.measure(e, nxt)) / 1000
    return dict(out)


def _lane(cover: Cover, a: float, b: float) -> list[list[float]]:
    """Segments of ``cover`` in ``[a, b)`` relative to ``a`` in ms, merged below a pixel."""
    res = (b - a) / TIMELINE_SEGMENTS
    out: list[list[float]] = []
    for s, e in cover.segments(a, b):
        if out and s - (a + out[-1][1] * 1000) < res:
            out[-1][1] = (e - a) / 1000
        else:
            out.append([(s - a) / 1000, (e - a) / 1000])
    return [[round(s, 4), round(e, 4)] for s, e in out]


def _timeline(
    steps: list[tuple[int, float, float, Any]],
    ops: Cover,
    coll: Cover,
    wait: Cover,
    g_comp: Cover,
    g_comm: Cover,
    g_mem: Cover,
    has_gpu: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, a, b, _ in steps:
        lanes = {"cpu_ops": _lane(ops, a, b), "cpu_collective": _lane(coll, a, b), "cpu_wait": _lane(wait, a, b)}
        if has_gpu:
            lanes.update(gpu_compute=_lane(g_comp, a, b), gpu_comm=_lane(g_comm, a, b), gpu_memcpy=_lane(g_mem, a, b))
        out[str(number)] = {"step_ms": (b - a) / 1000, "lanes": lanes}
    return out


# -- all ranks ----------------------------------------------------------------------------------
def _safe_analyze_rank(item: RankInput) -> dict[str, Any]:
    try:
        return analyze_rank(item)
    except TraceError as exc:
        return {"error": str(exc), "path": item.path, "rank": item.rank}
    except MemoryError:
        return {"error": f"{item.path}: out of memory analysing it", "path": item.path, "rank": item.rank}


def _decompressed_size(path: str) -> int:
    """A gzip file's uncompressed size from its trailer (modulo 4 GiB), else its size."""
    try:
        size = os.path.getsize(path)
        if not path.endswith(".gz") or size < 18:
            return size
        with open(path, "rb") as fh:
            fh.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(fh.read(4), "little"))
    except OSError:
        return 0


def default_workers(items: list[RankInput]) -> int:
    """One process per CPU (at most 32), fewer when the traces are large: each worker holds
    about as much memory as its trace's decompressed size at most (measured: 150 MB for a
    200 MB trace), and all of them together stay under half the available memory."""
    workers = min(len(items), os.cpu_count() or 1, 32)
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except Exception:
        return workers
    largest = max((_decompressed_size(i.path) for i in items), default=0)
    if largest > 0:
        workers = min(workers, max(1, available // 2 // largest))
    return workers


def analyze_ranks(items: list[RankInput], workers: int | None = None) -> list[dict[str, Any]]:
    """Analyse every rank's trace, in parallel processes (at most ``workers``; default:
    :func:`default_workers`)."""
    workers = workers or default_workers(items)
    if workers <= 1 or len(items) <= 1:
        return [_safe_analyze_rank(i) for i in items]
    import multiprocessing

    ctx = multiprocessing.get_context("spawn" if "torch" in __import__("sys").modules else "fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(_safe_analyze_rank, items, chunksize=1))


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _r(v: float, nd: int = 3) -> float:
    return round(float(v), nd)


def short_function(name: str) -> str:
    """``file.py(20): load_batch`` -> ``load_batch (file.py:20)``."""
    m = re.match(r"^(.*)\((\d+)\): (.+)$", name)
    if not m:
        return name
    return f"{m.group(3)} ({os.path.basename(m.group(1))}:{m.group(2)})"


def short_collective(name: str) -> str:
    """``c10d::allreduce_`` -> ``allreduce``; ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` ->
    ``AllReduce (nccl)``."""
    m = re.match(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    if m:
        return f"{m.group(1)} (nccl)"
    for prefix in ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:"):
        if name.startswith(prefix):
            return name[len(prefix) :].strip("_")
    return name


def combine(ranks: list[dict[str, Any]], top: int = 15, sources: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The job-wide analysis (the ``analysis.json`` schema) from per-rank results."""
    errors = [r for r in ranks if "error" in r]
    ok = sorted((r for r in ranks if "error" not in r), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    step_sets = [{s["step"] for s in r["steps"]} for r in ok]
    common = sorted(set.intersection(*step_sets)) if step_sets else []
    use = set(common) if common else None

    def rank_steps(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in r["steps"] if use is None or s["step"] in use]

    rank_rows = []
    for r in ok:
        rs = rank_steps(r)
        n = len(rs)
        cpu = {k: _r(_mean([s["cpu"][k] for s in rs])) for k in CPU_CATEGORIES}
        gpu = {k: _r(_mean([s["gpu"][k] for s in rs])) for k in GPU_CATEGORIES} if r["has_gpu"] else None
        comm_total = (gpu["comm"] + gpu["comm_overlap"]) if gpu else 0.0
        rank_rows.append(
            {
                "rank": r["rank"],
                "host": r["host"],
                "artifact": r["artifact"],
                "backend": r["backend"],
                "steps": n,
                "events": r["events"],
                "step_ms": _r(_mean([s["step_ms"] for s in rs])),
                "step_ms_median": _r(_median([s["step_ms"] for s in rs])),
                "cpu": cpu,
                "gpu": gpu,
                "overlap_pct": (_r(100 * gpu["comm_overlap"] / comm_total, 1) if gpu and comm_total > 0 else None),
                "work_ms": _r(_mean([s["work_ms"] for s in rs])),
                "collective_ms": _r(_mean([s["collective_ms"] for s in rs])),
                "device": r.get("device"),
            }
        )
    steps_out = []
    for number in common:
        per_rank = []
        for r in ok:
            s = next(x for x in r["steps"] if x["step"] == number)
            per_rank.append(
                {
                    "rank": r["rank"],
                    "step_ms": _r(s["step_ms"]),
                    "cpu": {k: _r(v) for k, v in s["cpu"].items()},
                    "gpu": {k: _r(v) for k, v in s["gpu"].items()} if s["gpu"] else None,
                    "work_ms": _r(s["work_ms"]),
                    "collective_ms": _r(s["collective_ms"]),
                }
            )
        steps_out.append({"step": number, "ranks": per_rank})
    n_steps = max(1, len(common))
    top_kernels = _top_table([r["kernels"] for r in ok], ok, top, n_steps, lambda v: (v[0], v[1], v[1]))
    top_ops = _top_table([r["ops"] for r in ok], ok, top, n_steps, lambda v: (v[0], v[1], v[2]))
    straggler, check = detect_straggler(ok, rank_rows, n_steps, steps_out)
    timeline = _pick_timeline(ok, common)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "sources": sources or [{"rank": r["rank"], "host": r["host"], "artifact": r["artifact"]} for r in ok],
        "errors": [{"rank": e.get("rank"), "path": e.get("path"), "error": e["error"]} for e in errors],
        "common_steps": common,
        "ranks": rank_rows,
        "steps": steps_out,
        "top_kernels": top_kernels,
        "top_ops": top_ops,
        "straggler": straggler,
        "straggler_check": check,
        "timeline": timeline,
    }


def _top_table(
    tables: list[dict[str, Any]],
    ok: list[dict[str, Any]],
    top: int,
    n_steps: int,
    unpack: Callable[[Any], tuple[float, float, float]],
) -> list[dict[str, Any]]:
    merged: dict[str, list[Any]] = {}
    for table, r in zip(tables, ok):
        for name, v in table.items():
            count, self_ms, total_ms = unpack(v)
            row = merged.setdefault(name, [0, 0.0, 0.0, {}])
            row[0] += count
            row[1] += self_ms
            row[2] += total_ms
            row[3][r["rank"]] = self_ms
    rows = sorted(merged.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    n_ranks = max(1, len(ok))
    out = []
    for name, (count, self_ms, total_ms, per_rank) in rows:
        slowest = max(per_rank.items(), key=lambda kv: kv[1])
        out.append(
            {
                "name": name,
                "count": int(count),
                "self_ms": _r(self_ms),
                "total_ms": _r(total_ms),
                "ms_per_step_per_rank": _r(self_ms / n_steps / n_ranks),
                "max_rank": slowest[0],
                "max_rank_ms": _r(slowest[1]),
            }
        )
    return out


def detect_straggler(
    ok: list[dict[str, Any]], rank_rows: list[dict[str, Any]], n_steps: int, steps: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str]:
    if len(rank_rows) < 2:
        return None, "one rank only: no straggler check"
    median_step = _median([r["step_ms_median"] for r in rank_rows])
    threshold = max(NOISE_FLOOR_MS, NOISE_FRACTION * median_step)
    rule = (
        f"noise threshold {threshold:.1f} ms = max({NOISE_FLOOR_MS:g} ms, "
        f"{NOISE_FRACTION * 100:g}% of the median step {median_step:.1f} ms)"
    )
    idx = max(range(len(rank_rows)), key=lambda i: rank_rows[i]["work_ms"])
    s_row = rank_rows[idx]
    others = [r for i, r in enumerate(rank_rows) if i != idx]
    others_work = _median([r["work_ms"] for r in others])
    others_wait = _median([r["collective_ms"] for r in others])
    excess = s_row["work_ms"] - others_work
    if excess <= threshold:
        return None, (
            f"no straggler: work outside collectives is within {excess:.1f} ms across ranks "
            f"(max rank {s_row['rank']} {s_row['work_ms']:.1f} ms/step vs {others_work:.1f} ms median); {rule}"
        )
    # Noise moves around; a straggler is the slowest rank in most steps.
    slowest = [max(st["ranks"], key=lambda x: x["work_ms"])["rank"] for st in steps]
    wins = sum(1 for r in slowest if r == s_row["rank"])
    if steps and wins * 2 < len(steps):
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more on average but is the slowest "
            f"in only {wins} of {len(steps)} steps; {rule}"
        )
    extra_wait = others_wait - s_row["collective_ms"]
    if extra_wait < 0.5 * excess:
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more, but the others do not wait "
            f"for it in collectives ({others_wait:.1f} ms/step vs {s_row['collective_ms']:.1f}); {rule}"
        )
    s = ok[idx]
    rest = [r for i, r in enumerate(ok) if i != idx]
    where, cause = _explain(s, rest, s_row, others, n_steps)
    shared = _contention(s, rest, cause)
    if shared:
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more{where}, but {shared}; {rule}"
        )
    coll_name = _top_collective(rest)
    reason = (
        f"rank {s_row['rank']}: {s_row['work_ms']:.1f} ms/step outside collectives{where} vs "
        f"{others_work:.1f} ms on the others; the others wait {others_wait:.1f} ms/step"
        f"{f' in {coll_name}' if coll_name else ' in collectives'}"
    )
    return (
        {
            "rank": s_row["rank"],
            "host": s_row["host"],
            "reason": reason,
            "cause": cause,
            "work_ms": s_row["work_ms"],
            "others_work_ms": _r(others_work),
            "others_wait_ms": _r(others_wait),
            "excess_ms": _r(excess),
            "threshold_ms": _r(threshold),
            "slowest_in_steps": wins,
        },
        f"straggler: rank {s_row['rank']} ({excess:.1f} ms/step over the others); {rule}",
    )


# Two ranks on one GPU do the same GPU work when their kernel and copy counts per step differ by
# at most this share (and their copied bytes by at most COPY_BYTES_TOLERANCE).
WORK_COUNT_TOLERANCE = 0.01
COPY_BYTES_TOLERANCE = 0.01
# Causes on the host's side, which another rank's use of the GPU does not slow.
_HOST_CAUSES = frozenset({"data loading", "input pipeline"})


def _work_per_step(r: dict[str, Any]) -> tuple[float, float, float, float]:
    """A rank's GPU work per traced step, whatever the GPU's speed: kernels, the threads they
    launched (a bigger input launches more), copies, bytes copied."""
    n = max(1, len(r["steps"]))
    kernels = sum(int(v[0]) for v in r["kernels"].values())
    copies = r.get("copies") or {}
    threads = int(r.get("kernel_threads") or 0)
    return kernels / n, threads / n, int(copies.get("count", 0)) / n, int(copies.get("bytes", 0)) / n


def _contention(s: dict[str, Any], rest: list[dict[str, Any]], cause: str) -> str:
    """Why the candidate's extra time is its GPU's contention, not its own slowness ("" where it
    is not): it shares one physical GPU with other ranks of the analysis, its extra time is on the
    GPU's side (not in data loading or the input pipeline), and it does the same GPU work per step
    as they do (kernels, the threads they launch, copies and bytes copied: counted, not timed;
    a trace whose kernels do not say their launch sizes cannot be told apart, and is judged as
    before). Ranks on one GPU take turns
    on it; in a job whose ranks wait for each other, the same rank can lose every turn."""
    device = s.get("device")
    if not device or cause in _HOST_CAUSES or not s.get("kernel_threads"):
        return ""
    peers = [r for r in rest if r.get("device") == device]
    if not peers:
        return ""
    k, t, c, b = _work_per_step(s)
    for p in peers:
        pk, pt, pc, pb = _work_per_step(p)
        if abs(k - pk) > max(1.0, WORK_COUNT_TOLERANCE * max(k, pk)):
            return ""
        if abs(t - pt) > WORK_COUNT_TOLERANCE * max(t, pt):
            return ""
        if abs(c - pc) > max(1.0, WORK_COUNT_TOLERANCE * max(c, pc)):
            return ""
        if abs(b - pb) > max(4096.0, COPY_BYTES_TOLERANCE * max(b, pb)):
            return ""
    names = ", ".join(str(p["rank"]) for p in peers[:8])
    return (
        f"it shares one GPU ({device[:40]}) with rank{'s' if len(peers) > 1 else ''} {names} and does the same GPU "
        f"work per step ({k:.0f} kernels, {c:.0f} {'copy' if round(c) == 1 else 'copies'} of {_mib(b)}): ranks on one GPU take turns on it, so "
        "their GPU-side times differ for no fault of either (give each rank its own GPU to compare them)"
    )


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


# What a CPU operator that holds a straggler's extra time says of its cause.
_DATA_LOADING = re.compile(r"DataLoader|dataloader|__next__|collate", re.IGNORECASE)
_H2D_OPS = re.compile(r"^(cudaMemcpy|cuMemcpy|aten::copy_|aten::_to_copy|aten::to$|Memcpy HtoD|aten::pin_memory)")
_LAUNCH_OPS = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunch|aten::)")


def _explain(
    s: dict[str, Any], rest: list[dict[str, Any]], s_row: dict[str, Any], others: list[dict[str, Any]], n_steps: int
) -> tuple[str, str]:
    """What the straggler spends its extra time on: (text for the reason, cause class). The
    cause is one of "GPU compute", "host launch", "host-to-device copy", "data loading",
    "input pipeline" (Python outside operators), "CPU operators"."""
    cats: dict[str, tuple[float, float]] = {}
    for k in ("ops", "outside_ops"):
        cats["cpu:" + k] = (s_row["cpu"][k], _mean([o["cpu"][k] for o in others]))
    if s_row["gpu"] is not None:
        cats["gpu:memcpy"] = (s_row["gpu"]["memcpy"], _mean([o["gpu"]["memcpy"] if o["gpu"] else 0.0 for o in others]))
        # compute kernels' whole time, overlapped with communication or not
        cats["gpu:compute"] = (
            s_row["gpu"]["compute"] + s_row["gpu"]["comm_overlap"],
            _mean([o["gpu"]["compute"] + o["gpu"]["comm_overlap"] if o["gpu"] else 0.0 for o in others]),
        )
    cat = max(cats, key=lambda k: cats[k][0] - cats[k][1])
    mine, theirs = cats[cat]
    if cat == "cpu:outside_ops":
        name = _top_excess(s, rest, "python_outside", n_steps)
        cause = "data loading" if name and _DATA_LOADING.search(name[0]) else "input pipeline"
        if name:
            return f" ({cause}, outside operators: {short_function(name[0])} {name[1]:.1f} ms/step)", cause
        hint = "data loading, Python; trace with --with-stack to name the function"
        return f" (outside operators {mine:.1f} ms vs {theirs:.1f}: {hint})", cause
    if cat == "cpu:ops":
        name = _top_excess(s, rest, "ops", n_steps)
        op = name[0] if name else ""
        if _DATA_LOADING.search(op):
            cause = "data loading"
        elif _H2D_OPS.match(op):
            cause = "host-to-device copy"
        elif _LAUNCH_OPS.match(op) and s_row["gpu"] is not None:
            cause = "host launch"
        else:
            cause = "CPU operators"
        detail = f": {op[:80]} {name[1]:.1f} ms/step" if name else ""
        if cause == "host launch":
            mine_k = sum(int(v[0]) for v in s["kernels"].values()) / n_steps
            theirs_k = _mean([sum(int(v[0]) for v in r["kernels"].values()) / n_steps for r in rest])
            detail += f"; {mine_k:.0f} kernels/step vs {theirs_k:.0f}"
        return f" ({cause}, CPU operators {mine:.1f} vs {theirs:.1f} ms{detail})", cause
    if cat == "gpu:compute":
        name = _top_excess(s, rest, "kernels", n_steps)
        return (
            f" (GPU compute {mine:.1f} vs {theirs:.1f} ms{f'; most in {name[0][:80]}' if name else ''})",
            "GPU compute",
        )
    return f" (host-to-device copy: GPU memory copies {mine:.1f} vs {theirs:.1f} ms)", "host-to-device copy"


def _top_excess(s: dict[str, Any], rest: list[dict[str, Any]], key: str, n_steps: int) -> tuple[str, float] | None:
    """The name whose time per step grew most over the other ranks' mean. For Python functions,
    among names within 5 % of the largest excess, the one with the shortest mean frame (the
    innermost of nested frames holding the same time: ``load_batch`` rather than ``train``)."""
    col = 0 if key == "python_outside" else 1
    excess: dict[str, float] = {}
    for name, v in s[key].items():
        theirs = _mean([float(r[key][name][col]) if name in r[key] else 0.0 for r in rest])
        excess[name] = (float(v[col]) - theirs) / n_steps
    if not excess:
        return None
    best = max(excess.values())
    if best <= 0:
        return None
    if key != "python_outside":
        name = max(excess, key=excess.__getitem__)
        return name, excess[name]
    near = [n for n, v in excess.items() if v >= 0.95 * best]
    name = min(near, key=lambda n: s[key][n][1] / max(1, s[key][n][2]))
    return name, excess[name]


def _top_collective(rest: list[dict[str, Any]]) -> str:
    totals: dict[str, float] = defaultdict(float)
    for r in rest:
        for name, ms in r["collectives"].items():
            totals[short_collective(name)] += ms
    if not totals:
        return ""
    return max(totals, key=totals.__getitem__)


def _pick_timeline(ok: list[dict[str, Any]], common: list[int]) -> dict[str, Any] | None:
    """One step's timeline per rank: the common step whose slowest rank is the median."""
    candidates = [n for n in common if all(str(n) in r["timeline"] for r in ok)]
    if not candidates:
        return None
    slowest = {n: max(r["timeline"][str(n)]["step_ms"] for r in ok) for n in candidates}
    ordered = sorted(candidates, key=slowest.__getitem__)
    step = ordered[len(ordered) // 2]
    return {
        "step": step,
        "ranks": [{"rank": r["rank"], **r["timeline"][str(step)]} for r in ok],
    }


# -- comparison ---------------------------------------------------------------------------------
def category_means(analysis: dict[str, Any]) -> dict[str, float]:
    """Mean over ranks of each per-step figure: ``step_ms``, ``cpu.*``, ``gpu.*``."""
    ranks = analysis.get("ranks") or []
    out: dict[str, float] = {"step_ms": _mean([float(r["step_ms"]) for r in ranks])}
    for k in CPU_CATEGORIES:
        out["cpu." + k] = _mean([float(r["cpu"][k]) for r in ranks])
    gpu_ranks = [r for r in ranks if r.get("gpu")]
    if gpu_ranks:
        for k in GPU_CATEGORIES:
            out["gpu." + k] = _mean([float(r["gpu"][k]) for r in gpu_ranks])
    return out


def compare(a: dict[str, Any], b: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Per-category deltas (B - A, ms per step, mean over ranks) and the kernels and
    operators whose time per step and rank moved most."""
    ma, mb = category_means(a), category_means(b)
    cats = []
    for k in [*ma, *(k for k in mb if k not in ma)]:
        va, vb = ma.get(k), mb.get(k)
        delta = None if va is None or vb is None else vb - va
        pct = None if delta is None or not va else 100 * delta / va
        cats.append(
            {
                "category": k,
                "a_ms": None if va is None else _r(va),
                "b_ms": None if vb is None else _r(vb),
                "delta_ms": None if delta is None else _r(delta),
                "delta_pct": None if pct is None else _r(pct, 1),
            }
        )

    def moved(key: str) -> list[dict[str, Any]]:
        ra = {r["name"]: float(r["ms_per_step_per_rank"]) for r in a.get(key, [])}
        rb = {r["name"]: float(r["ms_per_step_per_rank"]) for r in b.get(key, [])}
        rows = [
            {
                "name": n,
                "a_ms": _r(ra.get(n, 0.0)),
                "b_ms": _r(rb.get(n, 0.0)),
                "delta_ms": _r(rb.get(n, 0.0) - ra.get(n, 0.0)),
            }
            for n in set(ra) | set(rb)
        ]
        rows.sort(key=lambda r: abs(r["delta_ms"]), reverse=True)
        return rows[:top]

    return {
        "schema": SCHEMA + ".compare",
        "schema_version": SCHEMA_VERSION,
        "categories": cats,
        "kernels": moved("top_kernels"),
        "ops": moved("top_ops"),
        "straggler": {"a": a.get("straggler"), "b": b.get("straggler")},
    }


# -- text ---------------------------------------------------------------------------------------
def _fmt(v: Any, width: int = 8, nd: int = 1, sign: str = "") -> str:
    """``v`` right-aligned in ``width`` characters with ``nd`` decimals; a value too large for
    that in 3 significant digits (1.23e+15), never a 150-digit number; ``-`` for none or NaN."""
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return f"{'-':>{width}}"
    if not math.isfinite(x):
        return f"{'-':>{width}}"
    text = f"{x:{sign}.{nd}f}"
    if len(text) > width:
        text = f"{x:{sign}.3g}"
    return f"{text:>{width}}"


def render_text(analysis: dict[str, Any], top: int = 10) -> str:
    ranks = analysis.get("ranks") or []
    common = analysis.get("common_steps") or []
    lines = []
    backends = sorted({str(r.get("backend")) for r in ranks if r.get("backend")})
    gpu = any(r.get("gpu") for r in ranks)
    step_text = f"steps {common[0]}-{common[-1]} ({len(common)} in every rank)" if common else "no common steps"
    lines.append(
        f"{len(ranks)} rank(s), {step_text}; backend {', '.join(backends) or '-'}; "
        f"{'GPU' if gpu else 'CPU-only'} traces"
    )
    lines.append("")
    lines.append("ms per step, mean over steps; each row's categories add up to STEP")
    head = f"{'RANK':>4} {'HOST':<12} {'STEP':>8} | {'CPU OPS':>8} {'COLL':>8} {'WAIT':>8} {'OUTSIDE':>8}"
    if gpu:
        head += f" | {'COMPUTE':>8} {'OVERLAP':>8} {'COMM':>8} {'MEMCPY':>8} {'IDLE':>8} {'OVLP%':>6}"
    lines.append(head)
    for r in ranks:
        c = r["cpu"]
        row = (
            f"{r['rank'] if r['rank'] is not None else '-':>4} {str(r.get('host') or '-')[:12]:<12} "
            f"{_fmt(r['step_ms'])} | {_fmt(c['ops'])} {_fmt(c['collective'])} {_fmt(c['collective_wait'])} "
            f"{_fmt(c['outside_ops'])}"
        )
        if gpu:
            g = r.get("gpu") or {}
            row += (
                f" | {_fmt(g.get('compute'))} {_fmt(g.get('comm_overlap'))} {_fmt(g.get('comm'))} "
                f"{_fmt(g.get('memcpy'))} {_fmt(g.get('idle'))} {_fmt(r.get('overlap_pct'), 6)}"
            )
        lines.append(row)
    lines.append("")
    s = analysis.get("straggler")
    if s:
        lines.append(f"STRAGGLER on {s.get('host') or '?'}: {s['reason']}")
    lines.append(f"({analysis.get('straggler_check', '')})")
    for key, title in (("top_kernels", "top GPU kernels"), ("top_ops", "top CPU operators (self time)")):
        rows = (analysis.get(key) or [])[:top]
        if not rows:
            continue
        lines.append("")
        lines.append(f"{title:<60} {'calls':>7} {'total ms':>10} {'ms/step/rank':>12} {'max on':>7}")
        for row in rows:
            lines.append(
                f"{str(row['name'])[:60]:<60} {row['count']:>7} {_fmt(row['self_ms'], 10, 3)} "
                f"{_fmt(row['ms_per_step_per_rank'], 12, 3)} {'rank ' + str(row['max_rank']):>7}"
            )
    for e in analysis.get("errors") or []:
        lines.append(f"not analysed: rank {e.get('rank')}: {e['error']}")
    return "\n".join(one_line(line) for line in lines)


def render_compare_text(result: dict[str, Any], label_a: str, label_b: str) -> str:
    lines = [f"A = {label_a}", f"B = {label_b}", "", "ms per step, mean over ranks"]
    lines.append(f"{'category':<20} {'A':>9} {'B':>9} {'B-A':>9} {'%':>7}")
    for c in result["categories"]:
        lines.append(
            f"{c['category']:<20} {_fmt(c['a_ms'], 9, 2)} {_fmt(c['b_ms'], 9, 2)} "
            f"{_fmt(c['delta_ms'], 9, 2)} {_fmt(c['delta_pct'], 7)}"
        )
    for key, title in (("kernels", "GPU kernels that moved most"), ("ops", "CPU operators that moved most")):
        if not result[key]:
            continue
        lines.append("")
        lines.append(f"{title + ' (ms/step/rank)':<60} {'A':>9} {'B':>9} {'B-A':>9}")
        for row in result[key]:
            lines.append(
                f"{str(row['name'])[:60]:<60} {_fmt(row['a_ms'], 9, 3)} {_fmt(row['b_ms'], 9, 3)} "
                f"{_fmt(row['delta_ms'], 9, 3, sign='+')}"
            )
    for side in ("a", "b"):
        s = result["straggler"][side]
        lines.append(f"straggler in {side.upper()}: " + (s["reason"] if s else "none"))
    return "\n".join(one_line(line) for line in lines)


# -- artifacts ----------------------------------------------------------------------------------
MAX_ANALYSIS_FILE_BYTES = 64 * 1024**2


def load_analysis(artifact: Any) -> dict[str, Any]:
    """The analysis saved in an ``analysis`` artifact (bounded read, schema checked)."""
    from dynprof.errors import ArtifactError
    from dynprof.untrusted import loads_json

    what = f"{ANALYSIS_FILE} in {artifact.path}"
    try:
        data = loads_json(artifact.read_bytes(ANALYSIS_FILE, MAX_ANALYSIS_FILE_BYTES), what)
    except ArtifactError as exc:
        raise TraceError(str(exc)) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise TraceError(f"{what} is not a dynprof analysis")
    version = data.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise TraceError(f"{what}: schema version {version!r} is not one this dynprof reads")
    return data


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of an analysis artifact, for `dynprof show` and the web page."""
    data = load_analysis(artifact)
    summary = {k: data.get(k) for k in ("ranks", "common_steps", "straggler", "straggler_check")}
    return summary, render_text(data)


def render_html(artifact: Any) -> str:
    """Self-contained HTML (inline SVG, no script) of an analysis artifact, for the web page."""
    from collectors._analysis_html import analysis_html

    return analysis_html(load_analysis(artifact))
