"""Host-memory pressure: how close this process is to the kernel's OOM killer, and a capture
taken before it strikes.

:func:`read_usage` costs two small file reads (``/proc/self/statm`` and, with a cgroup limit,
the cgroup's ``memory.stat``), a few tens of microseconds; the agent's watcher thread calls it
once a second or so, never on the training thread. The limit is, in order: a configured one
(``DYNPROF_HOST_MEMORY_LIMIT``), the cgroup's (v2 ``memory.max``, v1
``memory.limit_in_bytes``, the smallest along the cgroup's ancestors), else the machine's
``MemTotal``.

An artifact of kind ``host-memory`` holds ``summary.json`` (RSS, peak RSS, the limit and where it
came from, cgroup usage and OOM-kill counters, system memory, the largest CPU tensors found),
``stacks.txt`` (Python stacks of all threads) and ``tensors.txt``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dynprof.onmain import NotRun, call_on_main
from dynprof.safetext import one_line
from dynprof.units import human_bytes

log = logging.getLogger("dynprof.agent")

KIND = "host-memory"
SUMMARY_FILE = "summary.json"
STACKS_FILE = "stacks.txt"
TENSORS_FILE = "tensors.txt"
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as 2**63 rounded down to a page
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# -- reading the figures ------------------------------------------------------------------------------
def _read(path: str | Path) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def process_rss(pid: int | str = "self") -> int:
    text = _read(f"/proc/{pid}/statm")
    if not text:
        return 0
    return int(text.split()[1]) * PAGE_SIZE


def process_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), VmSwap... in bytes, from /proc/PID/status."""
    out: dict[str, int] = {}
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Vm") or key in ("RssAnon", "RssFile", "RssShmem"):
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


@dataclass
class Cgroup:
    version: int  # 1 or 2
    path: str  # directory of the process's memory cgroup
    limit_dir: str | None = None  # directory whose limit is the smallest (the process's or an ancestor's)
    limit_bytes: int | None = None

    def usage(self) -> dict[str, int]:
        """Current usage, anon (not reclaimable) and file (page cache) bytes, OOM counters."""
        out: dict[str, int] = {}
        if self.version == 2:
            current = _int(_read(os.path.join(self.path, "memory.current")))
            stat_keys = {"anon": "anon_bytes", "file": "file_bytes", "shmem": "shmem_bytes"}
            events = _read(os.path.join(self.path, "memory.events")) or ""
            for line in events.splitlines():
                k, _, v = line.partition(" ")
                if k in ("oom", "oom_kill", "max", "high") and v.strip().isdigit():
                    out[f"events_{k}"] = int(v)
        else:
            current = _int(_read(os.path.join(self.path, "memory.usage_in_bytes")))
            stat_keys = {"total_rss": "anon_bytes", "total_cache": "file_bytes", "total_shmem": "shmem_bytes"}
            failcnt = _int(_read(os.path.join(self.path, "memory.failcnt")))
            if failcnt is not None:
                out["failcnt"] = failcnt
        if current is not None:
            out["current_bytes"] = current
        for line in (_read(os.path.join(self.path, "memory.stat")) or "").splitlines():
            k, _, v = line.partition(" ")
            if k in stat_keys and v.strip().isdigit():
                out[stat_keys[k]] = int(v)
        return out


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root within the hierarchy, mount point, fs type, super options) of cgroup mounts."""
    found = []
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        if rfields[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], rfields[0], rfields[2]))
    return found


def find_cgroup() -> Cgroup | None:
    """The memory cgroup of this process, with its effective limit."""
    lines = (_read("/proc/self/cgroup") or "").splitlines()
    v1_path = v2_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1_path = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
    candidates: list[tuple[int, str]] = []
    for root, point, fstype, opts in _mounts():
        if fstype == "cgroup" and v1_path is not None and "memory" in opts.split(","):
            candidates.append((1, _join(point, root, v1_path)))
        elif fstype == "cgroup2" and v2_path is not None:
            candidates.append((2, _join(point, root, v2_path)))
    limit_file = {1: "memory.limit_in_bytes", 2: "memory.max"}
    for version, directory in candidates:
        if not os.path.exists(os.path.join(directory, limit_file[version])):
            continue
        group = Cgroup(version=version, path=directory)
        # The effective limit is the smallest along the way up to the mount point.
        here = directory
        while True:
            value = _int(_read(os.path.join(here, limit_file[version])))
            if value is not None and (group.limit_bytes is None or value < group.limit_bytes):
                group.limit_bytes, group.limit_dir = value, here
            parent = os.path.dirname(here)
            if parent == here or not os.path.exists(os.path.join(parent, limit_file[version])):
                break
            here = parent
        if group.limit_bytes is not None or version == 2 or not any(v == 2 for v, _ in candidates):
            return group
    return None


def _join(mount_point: str, mount_root: str, cgroup_path: str) -> str:
    # In a cgroup namespace the process's path is relative to the mount's root already.
    rel = cgroup_path
    if mount_root != "/" and rel.startswith(mount_root):
        rel = rel[len(mount_root) :]
    return os.path.normpath(os.path.join(mount_point, rel.lstrip("/")))


@dataclass
class Limit:
    bytes: int
    source: str  # "configured", "cgroup v2 <dir>", "cgroup v1 <dir>", "MemTotal"


def resolve_limit(configured: int | None = None, cgroup: Cgroup | None = None) -> Limit:
    if configured:
        return Limit(configured, "configured")
    if cgroup is not None and cgroup.limit_bytes is not None:
        return Limit(cgroup.limit_bytes, f"cgroup v{cgroup.version} {cgroup.limit_dir}")
    return Limit(meminfo().get("MemTotal", 0), "MemTotal")


@dataclass
class Usage:
    rss_bytes: int
    cgroup_anon_bytes: int | None
    limit: Limit

    @property
    def pressure_bytes(self) -> int:
        """What is weighed against the limit: the process's RSS, or the cgroup's non-reclaimable
        (anonymous) memory when the limit is the cgroup's, since every process in it counts."""
        if self.limit.source.startswith("cgroup") and self.cgroup_anon_bytes is not None:
            return max(self.rss_bytes, self.cgroup_anon_bytes)
        return self.rss_bytes

    @property
    def fraction(self) -> float:
        return self.pressure_bytes / self.limit.bytes if self.limit.bytes else 0.0


def read_usage(limit: Limit, cgroup: Cgroup | None) -> Usage:
    anon = None
    if cgroup is not None and limit.source.startswith("cgroup"):
        anon = cgroup.usage().get("anon_bytes")
    return Usage(rss_bytes=process_rss(), cgroup_anon_bytes=anon, limit=limit)


# -- the capture ------------------------------------------------------------------------------------
def all_thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    chunks = []
    for ident, frame in sys._current_frames().items():
        chunks.append(
            f'Thread {ident} "{names.get(ident, "?")}" (most recent call last):\n'
            + "".join(traceback.format_stack(frame))
        )
    return "\n".join(chunks)


def find_cpu_tensors(
    limit: int = 20, max_objects: int = 200_000, max_depth: int = 6, threads: str = "all"
) -> tuple[list[dict[str, Any]], int]:
    """The largest CPU tensors reachable from the threads' frames and ``__main__``'s globals.

    ``threads``: ``"all"`` walks every other thread's frames; ``"own"`` walks only the calling
    thread's (from its caller up, dynprof's own frames left out). The agent calls it with
    ``"own"`` on the training thread (:func:`tensors_on_training_thread`): reading another
    thread's tensors, or its frames' locals, while that thread runs is what the agent never does.

    A bounded walk (``max_objects`` objects at most, ``max_depth`` levels) through frame locals,
    dicts, lists, tuples, sets and objects' ``__dict__`` (which covers nn.Modules' parameters and
    buffers and optimizers' state), deduplicated by storage. It does not scan the whole heap:
    ``gc.get_objects()`` would allocate a list of every object, which a process near its memory
    limit cannot afford. Returns the tensors, largest first, and the number of objects visited.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return [], 0
    tensor_type = torch.Tensor
    seen_ids: set[int] = set()
    storages: dict[int, dict[str, Any]] = {}
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    # Each entry: (object, path, depth); a path is a (parent path, step) chain, formatted only
    # for the tensors found.
    todo: list[tuple[Any, Any, int]] = []
    main = sys.modules.get("__main__")
    if main is not None:
        todo.append((vars(main), ("__main__",), 0))
    frames = sys._current_frames()
    if threads == "own":
        frames = {me: sys._getframe(1)}
    for ident, frame in frames.items():
        if ident == me and threads != "own":
            continue
        f: Any = frame
        while f is not None:
            if threads == "own" and f.f_code.co_filename.startswith(_OWN_DIRS):
                f = f.f_back  # dynprof's own frames (the pending call that runs this walk)
                continue
            label = (
                f"thread {names.get(ident, ident)}: {f.f_code.co_name}() "
                f"{Path(f.f_code.co_filename).name}:{f.f_lineno}",
            )
            try:
                todo.append((f.f_locals, label, 0))
            except Exception:
                pass
            f = f.f_back
    visited = 0
    skip_types = (type, type(sys), type(len), type(find_cpu_tensors), str, bytes, int, float, bool)
    while todo and visited < max_objects:
        obj, path, depth = todo.pop()
        if obj is None or isinstance(obj, skip_types) or id(obj) in seen_ids:
            continue
        seen_ids.add(id(obj))
        visited += 1
        try:
            if isinstance(obj, tensor_type):
                if obj.device.type != "cpu" or obj.is_sparse or obj.is_meta:
                    continue
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key and key not in storages:
                    storages[key] = {
                        "bytes": int(storage.nbytes()),
                        "shape": list(obj.shape),
                        "dtype": str(obj.dtype).replace("torch.", ""),
                        "where": path,
                    }
                continue
            if depth >= max_depth:
                continue
            if isinstance(obj, dict):
                for k, v in list(obj.items())[:10_000]:
                    todo.append((v, (path, k), depth + 1))
            elif isinstance(obj, (list, tuple, set, frozenset)):
                for i, v in enumerate(list(obj)[:10_000]):
                    todo.append((v, (path, i), depth + 1))
            else:
                d = getattr(obj, "__dict__", None)
                if isinstance(d, dict):
                    todo.append((d, (path, "."), depth + 1))
        except Exception:
            continue
    found = sorted(storages.values(), key=lambda t: t["bytes"], reverse=True)[:limit]
    for t in found:
        t["where"] = _format_path(t["where"])
    return found, visited


_OWN_DIRS = tuple(str(Path(__file__).resolve().parent.parent / name) + "/" for name in ("dynprof", "collectors"))
TENSOR_WAIT_S = 5.0  # how long the watcher waits for the training thread to read its own tensors


def tensors_on_training_thread(
    call_soon: Any, timeout_s: float = TENSOR_WAIT_S
) -> tuple[list[dict[str, Any]], int, str]:
    """:func:`find_cpu_tensors` run on the main (training) thread, at its next bytecode boundary,
    for a caller on another thread: (tensors, objects visited, a note when they could not be read).

    The walk reads tensors and frame locals; on the thread that owns them it races nothing. The
    caller waits at most ``timeout_s`` (a main thread inside one long C call runs no bytecode);
    a walk not begun by then is not run (:func:`dynprof.onmain.call_on_main`). ``call_soon(fn) ->
    bool`` queues ``fn`` on the main thread (the agent's pending-call queue)."""
    try:
        tensors, visited = call_on_main(call_soon, lambda: find_cpu_tensors(threads="own"), timeout_s)
    except NotRun as why:
        return [], 0, f"not read: {why}"
    except Exception:
        log.exception("the walk of the training thread's tensors failed")
        return [], 0, "not read: the walk failed (see the agent log)"
    return tensors, visited, ""


def _format_path(path: Any) -> str:
    steps: list[Any] = []
    while len(path) == 2:
        path, step = path
        steps.append(step)
    text = str(path[0])
    pending_attr = False
    for i, step in enumerate(reversed(steps)):
        if step == ".":
            pending_attr = True
            continue
        if i == 0 and isinstance(step, str):
            text += f" {step}"
        elif pending_attr and isinstance(step, str):
            text += f".{step}"
        else:
            text += f"[{step!r}]"
        pending_attr = False
    return text


def capture(
    store: Any,
    *,
    trigger: str,
    job: str | None,
    host: str | None,
    rank: int | None,
    usage: Usage,
    fraction: float,
    cgroup: Cgroup | None,
    options: dict[str, Any] | None = None,
    tensors_of: Any = None,
) -> Any:
    """Write one ``host-memory`` artifact; return the finished Artifact. ``tensors_of()`` gives
    (tensors, objects visited, note); by default this thread walks every thread's frames (a
    caller that owns them all); the agent's watcher passes :func:`tensors_on_training_thread` over its pending-call queue."""
    t0 = time.perf_counter()
    writer = store.create(
        KIND, job=job, host=host, rank=rank, options={"trigger": trigger, "fraction": fraction, **(options or {})}
    )
    try:
        stacks = all_thread_stacks()
        t1 = time.perf_counter()
        if tensors_of is None:
            tensors, visited = find_cpu_tensors()
            tensors_note = ""
        else:
            tensors, visited, tensors_note = tensors_of()
        tensors_s = time.perf_counter() - t1
        status = process_status()
        system = meminfo()
        summary: dict[str, Any] = {
            "trigger": trigger,
            "rss_bytes": usage.rss_bytes,
            "peak_rss_bytes": status.get("VmHWM"),
            "swap_bytes": status.get("VmSwap"),
            "rss_anon_bytes": status.get("RssAnon"),
            "rss_file_bytes": status.get("RssFile"),
            "limit_bytes": usage.limit.bytes,
            "limit_source": usage.limit.source,
            "pressure_bytes": usage.pressure_bytes,
            "usage_fraction": round(usage.fraction, 4),
            "threshold_fraction": fraction,
            "cgroup": (
                {"version": cgroup.version, "path": cgroup.path, "limit_bytes": cgroup.limit_bytes, **cgroup.usage()}
                if cgroup is not None
                else None
            ),
            "system": {k: system.get(k) for k in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")},
            "largest_cpu_tensors": tensors,
            "cpu_tensor_bytes_found": sum(t["bytes"] for t in tensors),
            "objects_visited": visited,
            "tensor_search_s": round(tensors_s, 4),
            "tensors_note": tensors_note,
            "threads": stacks.count('" (most recent call last):'),
        }
        writer.write_text(STACKS_FILE, stacks)
        writer.write_text(TENSORS_FILE, (f"({tensors_note})\n" if tensors_note else "") + format_tensors(tensors))
        summary["capture_s"] = round(time.perf_counter() - t0, 4)
        writer.write_json(SUMMARY_FILE, summary)
        return writer.finish(
            "complete",
            summary={
                k: summary[k]
                for k in (
                    "trigger",
                    "rss_bytes",
                    "limit_bytes",
                    "limit_source",
                    "usage_fraction",
                    "threshold_fraction",
                    "cpu_tensor_bytes_found",
                    "capture_s",
                )
            },
        )
    except BaseException as exc:
        if writer.finished is None:
            writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise


def _b(n: Any) -> str:
    return human_bytes(n, digits=1)


def format_tensors(tensors: list[dict[str, Any]]) -> str:
    if not tensors:
        return "(no CPU tensors found from the threads' frames and __main__)\n"
    lines = [f"{_b(t['bytes']):>11}  {t['dtype']:<9} {t['shape']!s:<22} {t['where']}" for t in tensors]
    return "\n".join(one_line(line) for line in lines) + "\n"


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of a host-memory artifact, for ``dynprof show``."""
    summary: dict[str, Any] = artifact.read_json(SUMMARY_FILE)  # the artifact's own file, with limits
    lines = [
        f"RSS {_b(summary['rss_bytes'])} (peak {_b(summary.get('peak_rss_bytes'))}) = "
        f"{summary['usage_fraction'] * 100:.1f} % of the limit {_b(summary['limit_bytes'])} "
        f"({summary['limit_source']}); threshold {summary['threshold_fraction'] * 100:.0f} %",
    ]
    cg = summary.get("cgroup")
    if cg:
        lines.append(
            f"cgroup v{cg['version']} {cg['path']}: usage {_b(cg.get('current_bytes'))}, "
            f"anon {_b(cg.get('anon_bytes'))}, page cache {_b(cg.get('file_bytes'))}"
            + (f", oom_kill events {cg['events_oom_kill']}" if "events_oom_kill" in cg else "")
        )
    system = summary.get("system") or {}
    lines.append(f"system: MemTotal {_b(system.get('MemTotal'))}, MemAvailable {_b(system.get('MemAvailable'))}")
    lines.append("")
    lines.append(
        f"largest CPU tensors ({summary['objects_visited']} objects searched in {summary['tensor_search_s']} s):"
    )
    lines.extend(format_tensors(summary.get("largest_cpu_tensors") or []).rstrip().split("\n"))
    stacks = Path(artifact.file(STACKS_FILE))
    if stacks.exists():
        lines.append("")
        lines.append(f"Python stacks of {summary.get('threads', '?')} threads in {STACKS_FILE}")
    return summary, "\n".join(one_line(line) for line in lines)


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "rss_bytes": usage.rss_bytes,
        "cgroup_anon_bytes": usage.cgroup_anon_bytes,
        "limit": asdict(usage.limit),
        "fraction": round(usage.fraction, 4),
    }
