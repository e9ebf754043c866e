"""One rank's trace reduced to its figures: per step, where the time goes; the top kernels and
operators; one step's timeline. And every rank's, in parallel processes.

A rank's trace is read in one streaming pass (:func:`.reader.iter_trace`); what the analysis
keeps per event is a few numbers in typed arrays (:class:`.intervals.Spans`), not the event.

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

Per step, ``collective_ms`` is the time spent waiting in collectives (GPU traces: GPU ``comm``,
or the CPU's collectives where they take longer; CPU-only traces: CPU ``collective +
collective_wait``) and ``work_ms`` the rest of the step: what :mod:`.job` compares across ranks.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.trace_analysis.intervals import Cover, Spans, cover_of
from collectors.trace_analysis.reader import DEFAULT_MAX_TRACE_BYTES, TraceError, iter_trace

TIMELINE_SEGMENTS = 400  # per lane and step, after merging segments shorter than a pixel
TIMELINE_STEPS = 64
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

# Span flags.
_OP, _COLL, _PY = 0, 1, 2
_COMPUTE, _COMM, _MEM = 0, 1, 2
# What an event is for the analysis.
_W_SKIP, _W_GPU, _W_THREAD, _W_STEP = 0, 1, 2, 3


def is_comm_op(name: str) -> bool:
    """Whether a CPU operator is a collective (``c10d::*``, ``gloo:*``, ``record_param_comms``, ...)."""
    return bool(_COMM_OP.match(name))


def is_comm_kernel(name: str) -> bool:
    """Whether a GPU kernel is a communication kernel (``nccl*``, ``rccl*``, all-reduce, ...)."""
    return bool(_COMM_KERNEL.search(name))


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

    threads: dict[tuple[Any, Any], Spans] = {}
    gpu = Spans()
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
                spans = threads[key] = Spans()
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
    train = threads.get(train_key, Spans())

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
    ops = cover_of(loop, lambda f: f != _PY)
    coll = cover_of(loop, lambda f: f == _COLL)
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
    return ops.gaps(a, b).minus(wait)


def _python_outside(
    train: Spans, outside: Cover, name_list: list[str], steps: list[tuple[int, float, float, Any]]
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


def _self_times(threads: dict[Any, Spans], name_list: list[str], a: float, b: float) -> dict[str, list[float]]:
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
    train: Spans,
    wait: Cover,
    name_list: list[str],
    g_comm: Cover,
    gpu: Spans,
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
