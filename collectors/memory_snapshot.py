"""CUDA memory snapshots: capture (at OOM or on demand), summary, and the artifact's reader.

An artifact of kind ``memory`` holds:

``snapshot.pickle``     ``torch.cuda.memory._snapshot()`` as PyTorch writes it (pickle protocol 4):
                        pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read it
``summary.json``        :func:`summarize_snapshot` plus what the capture knew: trigger, the failing
                        allocation, free/total memory, allocator statistics, capture timings
``memory_summary.txt``  ``torch.cuda.memory_summary()`` of each device in use
``stack.txt``           the Python stack of the thread that hit the OOM (or asked for the snapshot)

Capture runs inside the training process, possibly at the moment CUDA memory is exhausted:
it makes no CUDA allocation (the snapshot and the statistics are host-side copies of the
allocator's state), queries free/total only for devices that already have a context, and streams
the pickle to disk. Summaries and the reader need no torch: ``dynprof show`` and
``dynprof memory-report`` run anywhere.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import stat
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dynprof.errors import ArtifactError
from dynprof.units import human_bytes

KIND = "memory"
SNAPSHOT_FILE = "snapshot.pickle"
SUMMARY_FILE = "summary.json"
MEMORY_SUMMARY_FILE = "memory_summary.txt"
STACK_FILE = "stack.txt"
PICKLE_PROTOCOL = 4  # what torch's own _dump_snapshot writes on Python 3.8-3.13; the web viewer reads it
SUMMARY_SCHEMA = "dynprof.memory.summary"
SUMMARY_VERSION = 1

# Live blocks without a Python stack: allocated before recording started, with history off, or
# by threads that run no Python (the autograd engine's backward threads, C++ extensions).
NO_STACK = "(no Python stack recorded)"

ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")

# Frames inside PyTorch itself, the standard library or the interpreter never name an allocation
# site: the site is the first frame, from the innermost out, that is the user's (or a library's
# other than torch). Matched against the frame's filename.
_TORCH_FILE = re.compile(r"(^|/)torch/.+\.py$")
_STDLIB_FILE = re.compile(r"/lib/python3\.\d+/(?!site-packages/|dist-packages/)[^/]+(/[^/]+)?\.py$")


# -- reading snapshots ------------------------------------------------------------------------------
MAX_SNAPSHOT_BYTES = 4 << 30
"""A snapshot pickle larger than this is refused (``DYNPROF_MAX_SNAPSHOT_BYTES`` overrides)."""
MAX_BYTEARRAY_ARG = 1 << 20


def max_snapshot_bytes() -> int:
    env = os.environ.get("DYNPROF_MAX_SNAPSHOT_BYTES")
    if not env:
        return MAX_SNAPSHOT_BYTES
    from dynprof.units import parse_size

    return max(1, parse_size(env))


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as a pickle may call it: from bytes already in the file (or a string and
    its encoding, protocols 0-2), never from a size, so a few bytes cannot allocate gigabytes."""
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytearray(args[0])
    if len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return bytearray(args[0], args[1])
    if not args:
        return bytearray()
    raise pickle.UnpicklingError("it calls bytearray() with a size, which a memory snapshot never does")


MEMORY_GROWTH_MIN = 96 << 20
MEMORY_GROWTH_PER_BYTE = 24
"""Unpickling may grow the process by at most max(96 MiB, 24 x the pickle's size): a real
snapshot takes about 10x its pickle, while one-byte opcodes that each build an empty dict would
take 70x (a few MiB of them, hundreds of MB)."""
_CHECK_EVERY = 1 << 16


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _counting(op: Any) -> Any:
    def run(self: _SnapshotUnpickler) -> None:
        self._ops += 1
        if not self._ops % _CHECK_EVERY:
            self._check_memory()
        op(self)

    return run


class _SnapshotUnpickler(pickle._Unpickler):
    """Unpickles plain data only: a snapshot is dicts, lists, strings and numbers. Any other
    class reference is refused, so opening a file does not run code from it.

    The pure-Python unpickler: its memo is a dict, where the C unpickler sizes its memo array
    from the index a PUT names, so a 9-byte pickle could make it allocate gigabytes. Every
    65 536 opcodes it checks that the process has not grown past its budget
    (:data:`MEMORY_GROWTH_MIN`). It is about 6x slower than the C one, which is used instead
    where the process can cap its own address space (:func:`_unpickle`)."""

    dispatch = {code: _counting(op) for code, op in pickle._Unpickler.dispatch.items()}  # type: ignore[attr-defined]

    def __init__(self, file: Any, size: int = 0) -> None:
        super().__init__(file)
        self._ops = 0
        self._start_rss = _resident_bytes()
        self._budget = max(MEMORY_GROWTH_MIN, MEMORY_GROWTH_PER_BYTE * size)

    def _check_memory(self) -> None:
        grown = _resident_bytes() - self._start_rss
        if self._start_rss and grown > self._budget:
            raise pickle.UnpicklingError(
                f"it needs more than {self._budget >> 20} MiB of memory to load, far more than a "
                "snapshot of its size takes"
            )

    _ALLOWED = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "bytearray"):
            return _bytearray
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a memory snapshot never does")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which a memory snapshot never does")


class _FastSnapshotUnpickler(pickle.Unpickler):
    """The C unpickler with the same class rules, for a process that can bound its own
    address space while it runs (:func:`_address_space_limit`): its memo can then not
    allocate past the budget either."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "bytearray"):
            return _bytearray
        if (module, name) in _SnapshotUnpickler._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a memory snapshot never does")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which a memory snapshot never does")


@contextlib.contextmanager
def _address_space_limit(extra: int) -> Iterator[bool]:
    """Cap the address space at its current size + ``extra`` (a failed allocation is then a
    MemoryError, not gigabytes of RSS); yields False where that is not possible or not safe
    (another thread running, no /proc), and the caller must bound memory another way."""
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        yield False
        return
    try:
        import resource

        with open("/proc/self/statm", "rb") as fh:
            current = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
        limit = current + extra
        if old[1] != resource.RLIM_INFINITY and limit > old[1]:
            raise ValueError("hard limit")
        resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    except (OSError, ValueError, IndexError, ImportError):
        yield False
        return
    try:
        yield True
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def _unpickle(data: bytes) -> Any:
    budget = max(MEMORY_GROWTH_MIN, MEMORY_GROWTH_PER_BYTE * len(data))
    with _address_space_limit(budget) as limited:
        if limited:
            try:
                return _FastSnapshotUnpickler(io.BytesIO(data)).load()
            except MemoryError:
                raise pickle.UnpicklingError(
                    f"it needs more than {budget >> 20} MiB of memory to load, far more than a snapshot "
                    "of its size takes"
                ) from None
    return _SnapshotUnpickler(io.BytesIO(data), len(data)).load()


def load_snapshot(path: Path | str) -> dict[str, Any]:
    """Read a memory-snapshot pickle, with a precise error for anything that is not one."""
    path = Path(path)
    return parse_snapshot(_read_pickle(path), str(path))


def load_artifact_snapshot(artifact: Any) -> dict[str, Any]:
    """The snapshot of a memory artifact: only its own file, never through a link."""
    data = artifact.read_bytes(SNAPSHOT_FILE, max_snapshot_bytes())
    return parse_snapshot(data, str(artifact.file(SNAPSHOT_FILE)))


def _read_pickle(path: Path) -> bytes:
    cap = max_snapshot_bytes()
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ArtifactError(f"{path} is not a regular file")
            if st.st_size > cap:
                raise ArtifactError(
                    f"{path} is {st.st_size} bytes, over the {cap}-byte limit: refused",
                    help="Raise DYNPROF_MAX_SNAPSHOT_BYTES if it is a real snapshot.",
                )
            data = fh.read(cap + 1)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ArtifactError(
            f"{path} is a directory without a {SNAPSHOT_FILE}",
            help="Give a memory artifact (see `dynprof ls --kind memory`) or a snapshot pickle.",
        ) from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    if len(data) > cap:
        raise ArtifactError(f"{path} is over the {cap}-byte limit: refused")
    return data


def parse_snapshot(data: bytes, name: str = "snapshot") -> dict[str, Any]:
    help_text = (
        "A snapshot is the pickle that torch.cuda.memory._dump_snapshot() or dynprof writes "
        f"({SNAPSHOT_FILE} in a memory artifact)."
    )
    if not data:
        raise ArtifactError(f"{name} is empty, not a PyTorch memory snapshot", help=help_text)
    if data[:1] != b"\x80":
        raise ArtifactError(f"{name} is not a pickle, so not a PyTorch memory snapshot", help=help_text)
    try:
        obj = _unpickle(data)
    except EOFError:
        raise ArtifactError(
            f"{name} is truncated ({len(data)} bytes): the pickle ends early",
            help="The file was cut short (a full disk, a copy that stopped?); capture again.",
        ) from None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "truncated" in text or "ran out of input" in text.lower() or "exhausted before" in text:
            raise ArtifactError(
                f"{name} is truncated ({len(data)} bytes): {text}",
                help="The file was cut short (a full disk, a copy that stopped?); capture again.",
            ) from None
        raise ArtifactError(f"{name} is not a PyTorch memory snapshot: {text}", help=help_text) from None
    except RecursionError:
        raise ArtifactError(f"{name} nests too deeply to be a PyTorch memory snapshot", help=help_text) from None
    except MemoryError:
        raise ArtifactError(f"{name}: not enough memory to read it", help=help_text) from None
    except Exception as exc:  # malformed opcodes raise assorted errors
        raise ArtifactError(f"{name} is not a readable pickle: {type(exc).__name__}: {exc}", help=help_text) from None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("segments"), list)
        or not isinstance(obj.get("device_traces"), list)
    ):
        what = type(obj).__name__ + (f" with keys {sorted(map(str, obj))[:6]}" if isinstance(obj, dict) else "")
        raise ArtifactError(
            f"{name} is a pickle of a {what}, not a PyTorch memory snapshot (no 'segments' and 'device_traces')",
            help=help_text,
        )
    return obj


# -- summarising ---------------------------------------------------------------------------------------
def _is_site_frame(frame: dict[str, Any]) -> bool:
    filename = str(frame.get("filename", ""))
    if not filename.endswith(".py"):  # C++ frames, <frozen ...>, <string>, ??
        return False
    return not (_TORCH_FILE.search(filename) or _STDLIB_FILE.search(filename))


def format_frame(frame: dict[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def allocation_site(frames: list[dict[str, Any]] | None) -> str | None:
    """The innermost frame outside torch and the standard library, as ``file:line in func``."""
    if not frames:
        return None
    for frame in frames:
        if _is_site_frame(frame):
            return format_frame(frame)
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return format_frame(python[0] if python else frames[0])


def _short_stack(frames: list[dict[str, Any]] | None, limit: int = 8) -> list[str]:
    if not frames:
        return []
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")] or frames
    return [format_frame(f) for f in python[:limit]]


def _blocks(segment: dict[str, Any]) -> list[dict[str, Any]]:
    blocks = segment.get("blocks")
    return blocks if isinstance(blocks, list) else []


def summarize_snapshot(snapshot: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Per-device totals, fragmentation, largest live blocks, top allocation sites and the
    event history's shape, computed from the snapshot alone (no torch needed)."""
    devices: dict[int, dict[str, Any]] = {}
    live: list[tuple[int, int, dict[str, Any]]] = []  # (size, device, block)
    sites: dict[str, dict[str, Any]] = {}
    blocks_with_frames = 0

    def dev(index: int) -> dict[str, Any]:
        if index not in devices:
            devices[index] = {
                "device": index,
                "segments": 0,
                "blocks": 0,
                "reserved_bytes": 0,
                "allocated_bytes": 0,
                "requested_bytes": 0,
                "active_bytes": 0,
                "pending_free_bytes": 0,
                "inactive_bytes": 0,
                "largest_inactive_block": 0,
                "large_segments": 0,
                "small_segments": 0,
            }
        return devices[index]

    for seg in snapshot.get("segments", []):
        d = dev(int(seg.get("device", 0) or 0))
        d["segments"] += 1
        d["reserved_bytes"] += int(seg.get("total_size", 0) or 0)
        if seg.get("segment_type") == "small":
            d["small_segments"] += 1
        else:
            d["large_segments"] += 1
        for block in _blocks(seg):
            size = int(block.get("size", 0) or 0)
            state = str(block.get("state", ""))
            d["blocks"] += 1
            if state == "active_allocated":
                d["allocated_bytes"] += size
                d["active_bytes"] += size
                d["requested_bytes"] += int(block.get("requested_size", size) or 0)
            elif state in ACTIVE_STATES:
                d["pending_free_bytes"] += size
                d["active_bytes"] += size
            else:
                d["inactive_bytes"] += size
                d["largest_inactive_block"] = max(d["largest_inactive_block"], size)
            if state in ACTIVE_STATES:
                frames = block.get("frames") or []
                if frames:
                    blocks_with_frames += 1
                live.append((size, d["device"], block))
                site = allocation_site(frames) or NO_STACK
                entry = sites.setdefault(
                    site, {"site": site, "bytes": 0, "blocks": 0, "devices": set(), "stack": _short_stack(frames)}
                )
                entry["bytes"] += size
                entry["blocks"] += 1
                entry["devices"].add(d["device"])

    for d in devices.values():
        inactive = d["inactive_bytes"]
        # External fragmentation: how much of the cached free memory is unusable for one
        # allocation as large as all of it (0: one free block; near 1: scattered crumbs).
        d["fragmentation"] = round(1 - d["largest_inactive_block"] / inactive, 4) if inactive else 0.0
        d["cached_free_fraction"] = round(inactive / d["reserved_bytes"], 4) if d["reserved_bytes"] else 0.0

    live.sort(key=lambda item: item[0], reverse=True)
    largest = [
        {
            "device": device,
            "address": hex(int(b.get("address", 0) or 0)),
            "size": size,
            "requested_size": int(b.get("requested_size", size) or 0),
            "state": b.get("state"),
            "site": allocation_site(b.get("frames")),
            "stack": _short_stack(b.get("frames")),
        }
        for size, device, b in live[:top]
    ]
    top_sites = sorted(sites.values(), key=lambda s: s["bytes"], reverse=True)[:top]
    for s in top_sites:
        s["devices"] = sorted(s["devices"])

    traces = snapshot.get("device_traces") or []
    history: list[dict[str, Any]] = []
    ooms: list[dict[str, Any]] = []
    entries_with_frames = 0
    for index, entries in enumerate(traces):
        if not entries:
            continue
        actions = Counter(str(e.get("action")) for e in entries)
        times = [e["time_us"] for e in entries if isinstance(e.get("time_us"), (int, float)) and e["time_us"]]
        entries_with_frames += sum(1 for e in entries if e.get("frames"))
        history.append(
            {
                "device": index,
                "entries": len(entries),
                "actions": dict(actions),
                "span_s": round((max(times) - min(times)) / 1e6, 3) if len(times) > 1 else None,
            }
        )
        for e in entries:
            if e.get("action") == "oom":
                ooms.append(
                    {
                        "device": index,
                        "requested_bytes": int(e.get("size", 0) or 0),
                        "device_free_bytes": int(e.get("device_free", e.get("addr", 0)) or 0),
                        "site": allocation_site(e.get("frames")),
                        "stack": _short_stack(e.get("frames")),
                    }
                )
        dev(index)  # a device with history but no segments still appears

    return {
        "schema": SUMMARY_SCHEMA,
        "schema_version": SUMMARY_VERSION,
        "devices": [devices[k] for k in sorted(devices)],
        "totals": {
            k: sum(d[k] for d in devices.values())
            for k in ("reserved_bytes", "allocated_bytes", "active_bytes", "inactive_bytes", "segments", "blocks")
        },
        "largest_blocks": largest,
        "top_sites": top_sites,
        "history": history,
        "history_recorded": bool(history) or blocks_with_frames > 0,
        "stacks_recorded": blocks_with_frames > 0 or entries_with_frames > 0,
        "oom_events": ooms,
        "allocator_settings": snapshot.get("allocator_settings"),
    }


# -- capture (in the training process) -------------------------------------------------------------
def thread_stack(frame: Any = None, ident: int | None = None, name: str | None = None, limit: int = 60) -> str:
    """The Python stack of the calling thread (or of ``frame``, running in thread ``ident``),
    innermost last."""
    import sys
    import threading

    frame = frame if frame is not None else sys._getframe(1)
    if ident is None:
        ident, name = threading.get_ident(), threading.current_thread().name
    head = f'Thread {ident} "{name or "?"}" (most recent call last):\n'
    return head + "".join(traceback.format_stack(frame, limit=limit))


def _device_stats(torch: Any, index: int) -> dict[str, Any]:
    stats = torch.cuda.memory_stats(index)

    def get(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    return {
        "allocated_bytes": get("allocated_bytes.all.current"),
        "reserved_bytes": get("reserved_bytes.all.current"),
        "active_bytes": get("active_bytes.all.current"),
        "inactive_split_bytes": get("inactive_split_bytes.all.current"),
        "peak_allocated_bytes": get("allocated_bytes.all.peak"),
        "peak_reserved_bytes": get("reserved_bytes.all.peak"),
        "num_ooms": get("num_ooms"),
        "num_alloc_retries": get("num_alloc_retries"),
        "num_device_alloc": get("num_device_alloc"),
    }


def capture(
    store: Any,
    *,
    trigger: str,
    job: str | None,
    host: str | None,
    rank: int | None,
    history_policy: str,
    oom: dict[str, Any] | None = None,
    stack: str = "",
    options: dict[str, Any] | None = None,
    attribution: dict[str, Any] | None = None,
) -> Any:
    """Take the snapshot now and write one ``memory`` artifact; return the finished Artifact.

    ``oom`` carries what the allocator's out-of-memory observer passed: ``device``,
    ``requested_bytes`` (the cudaMalloc it could not make), ``device_limit_bytes`` (the
    device's memory, or the cap set with set_per_process_memory_fraction) and
    ``device_free_bytes``. ``attribution`` is what :func:`collectors._mem_advice.job_attribution`
    found in the job's objects (parameters, gradients, optimizer state, the failing frames' tensors).
    """
    import torch

    from collectors import _mem_advice

    t0 = time.perf_counter()
    snapshot = torch.cuda.memory._snapshot()
    t_snapshot = time.perf_counter() - t0

    writer = store.create(
        KIND,
        job=job,
        host=host,
        rank=rank,
        options={"trigger": trigger, "memory_history": history_policy, **(options or {})},
    )
    try:
        t1 = time.perf_counter()
        with open(writer.file_path(SNAPSHOT_FILE), "wb") as fh:
            pickle.dump(snapshot, fh, protocol=PICKLE_PROTOCOL)
        t_pickle = time.perf_counter() - t1

        t2 = time.perf_counter()
        summary = summarize_snapshot(snapshot)
        in_use = [d["device"] for d in summary["devices"] if d["segments"]]
        if oom is not None and oom.get("device") is not None and oom["device"] not in in_use:
            in_use.append(int(oom["device"]))
        live: dict[str, Any] = {}
        texts = []
        for index in sorted(in_use):
            entry: dict[str, Any] = {}
            try:
                entry.update(_device_stats(torch, index))
            except Exception as exc:
                entry["stats_error"] = f"{type(exc).__name__}: {exc}"
            if oom is not None and oom.get("device") == index:
                # The observer's figures, from the moment of the failure; the device's size is
                # a property cached on the host. (The observer's limit is the device's size or the
                # process's cap from set_per_process_memory_fraction, whichever applies.)
                entry["free_bytes"] = oom.get("device_free_bytes")
                entry["limit_bytes"] = oom.get("device_limit_bytes")
                try:
                    entry["total_bytes"] = int(torch.cuda.get_device_properties(index).total_memory)
                except Exception:
                    entry["total_bytes"] = oom.get("device_limit_bytes")
            else:
                try:  # this device has segments, so a context: cudaMemGetInfo allocates nothing
                    free, total = torch.cuda.mem_get_info(index)
                    entry["free_bytes"], entry["total_bytes"] = int(free), int(total)
                except Exception as exc:
                    entry["mem_info_error"] = f"{type(exc).__name__}: {exc}"
            try:
                entry["name"] = torch.cuda.get_device_name(index)
            except Exception:
                pass
            live[str(index)] = entry
            try:
                texts.append(f"==== cuda:{index} ====\n{torch.cuda.memory_summary(index)}")
            except Exception as exc:
                texts.append(f"==== cuda:{index} ====\n(memory_summary failed: {type(exc).__name__}: {exc})\n")
        failing: dict[str, Any] | None = None
        if oom is not None:
            failing = dict(oom)
            recorded = [o for o in summary["oom_events"] if o["device"] == oom.get("device")]
            if recorded:  # the allocator's own record has the caller's requested size and stack
                failing["requested_bytes"] = recorded[-1]["requested_bytes"]
                failing["site"] = recorded[-1]["site"]
            failing["segment_request_bytes"] = oom.get("requested_bytes")
        summary.update(
            trigger=trigger,
            memory_history=history_policy,
            torch_version=getattr(torch, "__version__", None),
            failing_allocation=failing,
            device_memory=live,
            size_classes=_mem_advice.size_classes(snapshot),
        )
        if attribution is not None:
            summary["attribution"] = attribution
        summary["advice"] = _mem_advice.advise(summary)
        t_summary = time.perf_counter() - t2
        writer.write_text(MEMORY_SUMMARY_FILE, "\n".join(texts))
        writer.write_text(STACK_FILE, stack or "(no stack)\n")
        summary["capture"] = {
            "snapshot_s": round(t_snapshot, 4),
            "pickle_s": round(t_pickle, 4),
            "summary_s": round(t_summary, 4),
            "total_s": round(time.perf_counter() - t0, 4),
            "pickle_bytes": writer.file_path(SNAPSHOT_FILE).stat().st_size,
            "history_entries": sum(h["entries"] for h in summary["history"]),
        }
        writer.write_json(SUMMARY_FILE, summary)
        return writer.finish("complete", summary=manifest_summary(summary))
    except BaseException as exc:
        if writer.finished is None:
            writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise


def manifest_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The few fields that go into the manifest and the CLI's one-line result."""
    top = summary["top_sites"][0] if summary.get("top_sites") else None
    failing = summary.get("failing_allocation") or {}
    return {
        "trigger": summary.get("trigger"),
        "memory_history": summary.get("memory_history"),
        "allocated_bytes": summary["totals"]["allocated_bytes"],
        "reserved_bytes": summary["totals"]["reserved_bytes"],
        "failing_device": failing.get("device"),
        "failing_bytes": failing.get("requested_bytes"),
        "top_site": top["site"] if top else None,
        "top_site_bytes": top["bytes"] if top else None,
        "capture_s": (summary.get("capture") or {}).get("total_s"),
        "pickle_bytes": (summary.get("capture") or {}).get("pickle_bytes"),
        "advice": [a.get("rule") for a in summary.get("advice") or [] if isinstance(a, dict)],
    }


# -- text rendering -----------------------------------------------------------------------------------
def _b(n: Any) -> str:
    return human_bytes(n, digits=2)


def oom_sentence(failing: dict[str, Any]) -> str:
    """One line on the failed allocation: size, site, and what limited it."""
    where = f" at {failing['site']}" if failing.get("site") else ""
    free, limit = failing.get("device_free_bytes"), failing.get("device_limit_bytes")
    head = f"CUDA out of memory on cuda:{failing.get('device')}: tried to allocate {_b(failing.get('requested_bytes'))}{where}"
    if isinstance(free, int) and isinstance(limit, int) and free > limit:
        # The allocator refused because of the process's cap, not because the device was full.
        return f"{head}; the process is capped at {_b(limit)} (set_per_process_memory_fraction), {_b(free)} free on the device"
    return f"{head}; {_b(free)} free of {_b(limit)}"


def format_summary(summary: dict[str, Any], top: int = 10) -> str:
    lines: list[str] = []
    failing = summary.get("failing_allocation")
    if summary.get("trigger"):
        lines.append(
            f"trigger: {summary['trigger']}   memory history: {summary.get('memory_history', '?')}"
            + (f"   torch {summary['torch_version']}" if summary.get("torch_version") else "")
        )
    if failing:
        lines.append(oom_sentence(failing))
    if not failing:
        for o in (summary.get("oom_events") or [])[-3:]:
            where = f" at {o['site']}" if o.get("site") else ""
            lines.append(
                f"recorded OOM on cuda:{o['device']}: tried to allocate {_b(o['requested_bytes'])}{where}; "
                f"{_b(o['device_free_bytes'])} free"
            )
    live = summary.get("device_memory") or {}
    lines.append("")
    lines.append(
        f"{'device':<8} {'allocated':>11} {'active':>11} {'reserved':>11} {'cached free':>11} "
        f"{'frag':>5} {'free (CUDA)':>12} {'total':>11} {'segments':>8}"
    )
    for d in summary.get("devices", []):
        extra = live.get(str(d["device"]), {})
        lines.append(
            f"cuda:{d['device']:<3} {_b(d['allocated_bytes']):>11} {_b(d['active_bytes']):>11} "
            f"{_b(d['reserved_bytes']):>11} {_b(d['inactive_bytes']):>11} {d['fragmentation']:>5.2f} "
            f"{_b(extra.get('free_bytes')) if extra else '-':>12} "
            f"{_b(extra.get('total_bytes')) if extra else '-':>11} {d['segments']:>8}"
        )
    sites = summary.get("top_sites") or []
    if sites:
        lines.append("")
        if not summary.get("stacks_recorded"):
            note = " — no stacks: memory history was off"
        elif str(summary.get("memory_history", "")).startswith("auto"):
            with_stack = sum(s["bytes"] for s in sites if s["site"] != NO_STACK)
            note = (
                " — sampled: `auto` records stacks in windows, so only blocks allocated during one have a site"
                f" ({_b(with_stack)} of the top sites' bytes)"
            )
        else:
            note = ""
        lines.append(f"top allocation sites (live blocks, by bytes){note}:")
        for s in sites[:top]:
            lines.append(f"  {_b(s['bytes']):>11}  {s['blocks']:>6} blocks  {s['site']}")
    largest = summary.get("largest_blocks") or []
    if largest:
        lines.append("")
        lines.append("largest live blocks:")
        for b in largest[:top]:
            lines.append(f"  {_b(b['size']):>11}  cuda:{b['device']} {b['address']}  {b.get('site') or NO_STACK}")
    if not summary.get("stacks_recorded") and summary.get("size_classes"):
        lines.append("")
        lines.append("blocks by pool and size class (no stacks recorded):")
        for r in summary["size_classes"]:
            if r["state"] == "allocated":
                lines.append(
                    f"  cuda:{r['device']} {r['pool']:<5} {r['size_class']:<14} {r['blocks']:>7} blocks {_b(r['bytes']):>11}"
                )
    att = summary.get("attribution")
    if isinstance(att, dict):
        lines.append("")
        lines.append(
            f"held by the job's objects: parameters {_b(att.get('parameters_bytes'))}, gradients "
            f"{_b(att.get('gradients_bytes'))}, optimizer state {_b(att.get('optimizer_state_bytes'))} "
            f"({att.get('optimizers', 0)} optimizers); tensors in the failing frames {_b(att.get('frame_tensors_bytes'))}"
        )
        for t in (att.get("frame_tensors") or [])[:5]:
            many = f" {t.get('tensors')} tensors, e.g." if int(t.get("tensors", 1) or 1) > 1 else ""
            lines.append(
                f"  {_b(t.get('bytes')):>11}  {t.get('name')}{many} {t.get('dtype')}{t.get('shape')}  in {t.get('frame')}"
            )
    advice = summary.get("advice") or []
    if advice:
        lines.append("")
        lines.append("advice:")
        for a in advice:
            lines.append(f"  [{a.get('rule')}] {a.get('reason')}")
            lines.append(f"      -> {a.get('advice')}")
    hist = summary.get("history") or []
    lines.append("")
    if hist:
        for h in hist:
            acts = ", ".join(f"{k} {v}" for k, v in sorted(h["actions"].items()))
            span = f" over {h['span_s']} s" if h.get("span_s") is not None else ""
            lines.append(f"history cuda:{h['device']}: {h['entries']} events{span} ({acts})")
    else:
        lines.append("history: none recorded (recording was off, or nothing was allocated since it started)")
    cap = summary.get("capture")
    if cap:
        lines.append(
            f"capture: {cap['total_s']} s (snapshot {cap['snapshot_s']} s, pickle {cap['pickle_s']} s, "
            f"{_b(cap['pickle_bytes'])}, {cap['history_entries']} history events)"
        )
    return "\n".join(lines)


def read_summary(artifact: Any) -> dict[str, Any]:
    """The artifact's summary.json (read with limits), else a summary computed from its snapshot."""
    if artifact.has_file(SUMMARY_FILE):
        data = artifact.read_json(SUMMARY_FILE)
        if not isinstance(data, dict):
            raise ArtifactError(f"{SUMMARY_FILE} of {artifact.path} is not a JSON object")
        return data
    return summarize_snapshot(load_artifact_snapshot(artifact))


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of a memory artifact, for ``dynprof show``."""
    summary = read_summary(artifact)
    text = format_summary(summary)
    if artifact.has_file(STACK_FILE):
        stack = artifact.read_text(STACK_FILE).rstrip()
        tail = stack.splitlines()[-12:]
        text += (
            "\n\nstack of the thread that "
            + ("hit the OOM" if summary.get("trigger") == "oom" else "took it")
            + " (innermost last):\n"
            + "\n".join(tail)
        )
    return summary, text
