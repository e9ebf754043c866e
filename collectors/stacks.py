"""Stacks of running processes (and core files), and the merged view of many ranks.

Capture methods, each producing a :class:`ProcessStacks` in one JSON schema:

* ``py-spy`` (``py-spy dump --json``): reads the target's memory from outside; works when the
  target holds the GIL in C code, runs no Python, or is stopped. Fast (~0.1 s per process).
* ``pystack`` (through ``python -m collectors._pystack_dump``, a subprocess so a crash of the
  reader never takes the CLI down): native frames merged with Python frames, GIL holder, core
  files.
* ``agent``: the dynprof agent inside the process walks ``sys._current_frames()``; needs the GIL
  and a running interpreter, but no ptrace permission.
* ``faulthandler``: the hang watchdog's GIL-free dump, parsed from faulthandler's text.

Frames are stored innermost first. :func:`group_processes` groups processes by the stack of
their main thread and finds, for each smaller group, the frame where it departs from the
largest one. :func:`render_merged` and :func:`render_artifact` turn that into text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynprof.errors import ArtifactError

SCHEMA = "dynprof.stacks"
SCHEMA_VERSION = 1
KIND = "stacks"
HANG_KIND = "hang"

# -- data -------------------------------------------------------------------------------------


@dataclass
class Frame:
    function: str
    file: str
    line: int = 0
    native: bool = False
    library: str | None = None
    locals: dict[str, str] | None = None

    def key(self) -> tuple[str, str, int]:
        """Identity for grouping: native frames by symbol and library (addresses vary)."""
        if self.native:
            return (self.function, os.path.basename(self.library or self.file), 0)
        return (self.function, self.file, self.line)

    def where(self) -> str:
        if self.native:
            lib = os.path.basename(self.library or self.file or "?")
            return f"{short_symbol(self.function)} [{lib}]"
        return f"{self.function} ({short_path(self.file)}:{self.line})"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frame:
        return cls(
            function=str(d.get("function", "?")),
            file=str(d.get("file", "")),
            line=int(d.get("line") or 0),
            native=bool(d.get("native", False)),
            library=d.get("library"),
            locals=d.get("locals"),
        )


@dataclass
class ThreadStack:
    tid: int  # the OS thread id (the main thread's equals the pid)
    name: str | None = None
    main: bool = False
    holds_gil: bool | None = None  # None: the reader cannot tell
    active: bool | None = None  # running (not idle/waiting), where the reader can tell
    frames: list[Frame] = field(default_factory=list)  # innermost first

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ThreadStack:
        return cls(
            tid=int(d.get("tid") or 0),
            name=d.get("name"),
            main=bool(d.get("main", False)),
            holds_gil=d.get("holds_gil"),
            active=d.get("active"),
            frames=[Frame.from_dict(f) for f in d.get("frames", [])],
        )


@dataclass
class ProcessStacks:
    pid: int
    method: str  # py-spy, pystack, agent, faulthandler, pystack-core
    native: bool = False
    rank: int | None = None
    job: str | None = None
    host: str | None = None
    threads: list[ThreadStack] = field(default_factory=list)
    captured_at: float = 0.0
    duration_s: float = 0.0
    fallback_reason: str | None = None  # why an earlier method failed, when one did
    fallback_help: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessStacks:
        return cls(
            pid=int(d.get("pid") or 0),
            method=str(d.get("method", "?")),
            native=bool(d.get("native", False)),
            rank=d.get("rank"),
            job=d.get("job"),
            host=d.get("host"),
            threads=[ThreadStack.from_dict(t) for t in d.get("threads", [])],
            captured_at=float(d.get("captured_at") or 0.0),
            duration_s=float(d.get("duration_s") or 0.0),
            fallback_reason=d.get("fallback_reason"),
            fallback_help=d.get("fallback_help"),
            notes=list(d.get("notes") or []),
        )

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.main:
                return t
        for t in self.threads:
            if t.tid == self.pid:
                return t
        return self.threads[0] if self.threads else None


class CaptureError(Exception):
    """A method could not read the stacks; ``reason`` says why in a person's words."""

    def __init__(self, method: str, reason: str) -> None:
        super().__init__(f"{method}: {reason}")
        self.method = method
        self.reason = reason


# -- paths ----------------------------------------------------------------------------------------
_LIB_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def short_path(path: str) -> str:
    """``.../site-packages/torch/distributed/x.py`` -> ``torch/distributed/x.py``."""
    for marker in _LIB_MARKERS:
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    m = _STDLIB.search(path)
    if m:
        return path[m.end() :]
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return path


def short_symbol(symbol: str, limit: int = 100) -> str:
    """Collapse C++ template arguments and parameter lists of long symbols."""
    if len(symbol) <= limit:
        return symbol
    out: list[str] = []
    depth = 0
    for ch in symbol:
        if ch in "<(":
            if depth == 0:
                out.append(ch + "...")
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
            if depth == 0:
                out.append(ch)
        elif depth == 0:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SYSTEM_LIBS = ("libc.", "libc-", "libstdc++", "libpthread", "ld-linux", "libgcc", "libpython", "python")


def is_library_path(path: str) -> bool:
    return any(m in path for m in _LIB_MARKERS) or bool(_STDLIB.search(path)) or path.startswith("<frozen")


# -- out-of-process readers ----------------------------------------------------------------------
def find_tool(name: str) -> str | None:
    """``DYNPROF_PY_SPY`` / ``DYNPROF_PYSTACK`` override, PATH, then next to this interpreter."""
    env = os.environ.get("DYNPROF_" + name.upper().replace("-", "_"))
    if env is not None:
        return env or None
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


def ptrace_refusal(pid: int) -> str | None:
    """Why reading ``pid``'s memory from outside is refused, or None if it is permitted.

    Opening ``/proc/PID/mem`` goes through the kernel's ptrace access check (uid, dumpable
    flag, CAP_SYS_PTRACE, Yama's ptrace_scope) without stopping or touching the process.
    """
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except FileNotFoundError:
        return None  # gone; the reader will say so
    except PermissionError as exc:
        scope = ""
        try:
            scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
        except OSError:
            pass
        detail = f" (kernel.yama.ptrace_scope={scope})" if scope else ""
        return f"the kernel refused to let this process read pid {pid}'s memory: {exc.strerror}{detail}"
    except OSError:
        return None
    os.close(fd)
    return None


def looks_like_python(pid: int) -> bool | None:
    """Whether ``pid`` runs a Python interpreter (None: cannot tell)."""
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = ""
    if exe.startswith("python") or exe.startswith("pypy"):
        return True
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                if "libpython" in line:
                    return True
    except OSError:
        return None
    return False


def _run_tool(cmd: list[str], method: str, timeout: float) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise CaptureError(method, f"{cmd[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise CaptureError(method, f"no answer within {timeout:g} s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        # py-spy appends a Rust backtrace; its first line is the message.
        message = (
            next((ln for ln in lines if not ln.startswith(("Stack backtrace", "0:"))), "") or f"exit {proc.returncode}"
        )
        message = message.removeprefix("Error: ").strip("💀 ").strip()
        raise CaptureError(method, message)
    return proc.stdout


def capture_py_spy(pid: int, native: bool = False, locals: bool = False, timeout: float = 10.0) -> ProcessStacks:
    exe = find_tool("py-spy")
    if exe is None:
        raise CaptureError("py-spy", "py-spy is not installed (pip install py-spy)")
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    if locals:
        cmd.append("--locals")
    t0 = time.monotonic()
    out = _run_tool(cmd, "py-spy", timeout)
    try:
        data = json.loads(out)
    except ValueError as exc:
        raise CaptureError("py-spy", f"unreadable output: {exc}") from None
    return ProcessStacks(
        pid=pid,
        method="py-spy",
        native=native,
        threads=parse_py_spy(data, pid),
        captured_at=time.time(),
        duration_s=time.monotonic() - t0,
    )


def parse_py_spy(data: Sequence[dict[str, Any]], pid: int) -> list[ThreadStack]:
    threads = []
    for t in data:
        frames: list[Frame] = []
        for f in t.get("frames", []):
            module = f.get("module")  # set (the library) for native frames only
            is_native = bool(module)
            frames.append(
                Frame(
                    function=str(f.get("name", "?")),
                    file=str(f.get("filename", "")),
                    line=int(f.get("line") or 0),
                    native=is_native,
                    library=str(module) if is_native else None,
                    locals={str(v["name"]): str(v.get("repr")) for v in f.get("locals") or [] if "name" in v} or None,
                )
            )
        tid = int(t.get("os_thread_id") or 0)
        threads.append(
            ThreadStack(
                tid=tid,
                name=t.get("thread_name"),
                main=tid == pid or t.get("thread_name") == "MainThread",
                holds_gil=bool(t.get("owns_gil")),
                active=t.get("active"),
                frames=frames,
            )
        )
    return threads


def _pystack_cmd(args: list[str]) -> list[str]:
    override = find_tool("pystack-python")  # DYNPROF_PYSTACK_PYTHON: an interpreter with pystack
    return [override or sys.executable, "-m", "collectors._pystack_dump", *args]


def capture_pystack(pid: int, native: bool = False, locals: bool = False, timeout: float = 20.0) -> ProcessStacks:
    args = ["--pid", str(pid)] + (["--native"] if native else []) + (["--locals"] if locals else [])
    t0 = time.monotonic()
    out = _run_tool(_pystack_cmd(args), "pystack", timeout)
    try:
        data = json.loads(out)
    except ValueError as exc:
        raise CaptureError("pystack", f"unreadable output: {exc}") from None
    ps = ProcessStacks.from_dict(data)
    ps.duration_s = time.monotonic() - t0
    return ps


def capture_core(
    core: str, executable: str | None = None, native: bool = False, locals: bool = False, timeout: float = 120.0
) -> ProcessStacks:
    args = ["--core", core] + (["--executable", executable] if executable else [])
    args += (["--native"] if native else []) + (["--locals"] if locals else [])
    t0 = time.monotonic()
    out = _run_tool(_pystack_cmd(args), "pystack", timeout)
    ps = ProcessStacks.from_dict(json.loads(out))
    ps.duration_s = time.monotonic() - t0
    return ps


# -- in-process readers (agent side) ------------------------------------------------------------
def capture_in_process(locals: bool = False, max_depth: int = 256) -> ProcessStacks:
    """Every thread's Python stack, read by the calling thread (the agent's server thread)."""
    import threading

    t0 = time.monotonic()
    frames_by_ident = sys._current_frames()
    by_ident = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    me = threading.get_ident()
    threads = []
    for ident, top in frames_by_ident.items():
        thread = by_ident.get(ident)
        frames: list[Frame] = []
        f: Any = top
        while f is not None and len(frames) < max_depth:
            code = f.f_code
            loc = None
            if locals:
                loc = {}
                for k, v in list(f.f_locals.items())[:50]:
                    try:
                        text = repr(v)
                    except Exception as exc:
                        text = f"<repr failed: {type(exc).__name__}>"
                    loc[str(k)] = text[:200]
            frames.append(
                Frame(
                    function=getattr(code, "co_qualname", code.co_name),
                    file=code.co_filename,
                    line=int(f.f_lineno or 0),
                    locals=loc,
                )
            )
            f = f.f_back
        native_id = getattr(thread, "native_id", None) if thread is not None else None
        threads.append(
            ThreadStack(
                tid=int(native_id or 0) or (os.getpid() if ident == main_ident else 0),
                name=thread.name if thread is not None else None,
                main=ident == main_ident,
                holds_gil=None,
                active=None if ident != me else True,
                frames=frames,
            )
        )
    threads.sort(key=lambda t: (not t.main, t.tid))
    return ProcessStacks(
        pid=os.getpid(),
        method="agent",
        threads=threads,
        captured_at=time.time(),
        duration_s=time.monotonic() - t0,
        notes=["read inside the process: Python frames only; the GIL holder is unknown"],
    )


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[(.*?)\])? \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse_faulthandler(
    text: str, pid: int, names: dict[int, tuple[str, int | None]] | None = None, main_ident: int | None = None
) -> list[ThreadStack]:
    """Parse ``faulthandler.dump_traceback(all_threads=True)`` output (innermost first already).

    ``names`` maps thread idents to (name, native id) as known to the process.
    """
    threads: list[ThreadStack] = []
    current: ThreadStack | None = None
    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            ident = int(m.group(2), 16)
            name, native_id = (names or {}).get(ident, (m.group(3), None))
            current = ThreadStack(
                tid=int(native_id or 0),
                name=name or m.group(3),
                main=(ident == main_ident) if main_ident is not None else False,
            )
            threads.append(current)
            continue
        m = _FH_FRAME.match(line)
        if m and current is not None:
            lineno = int(m.group(2)) if m.group(2).isdigit() else 0
            current.frames.append(Frame(function=m.group(3).strip(), file=m.group(1), line=lineno))
    if main_ident is None and threads:
        threads[-1].main = True  # faulthandler lists the main thread last
    for t in threads:
        if t.main and not t.tid:
            t.tid = pid
    threads.sort(key=lambda t: not t.main)
    return threads


# -- grouping -------------------------------------------------------------------------------------
@dataclass
class Group:
    members: list[ProcessStacks]
    frames: list[Frame]  # the shared main-thread stack, innermost first
    diverges_at: Frame | None = None  # this group's frame where it departs from group 1
    reference_at: Frame | None = None  # group 1's frame at that depth
    outlier: bool = False
    by_host: bool = False  # name each member's host (processes of several nodes)

    @property
    def labels(self) -> str:
        return rank_labels(self.members, by_host=self.by_host)

    def headline(self) -> str:
        return headline(self.frames)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "ranks": [m.rank for m in self.members],
            "pids": [m.pid for m in self.members],
            "label": self.labels,
            "size": len(self.members),
            "outlier": self.outlier,
            "headline": self.headline(),
            "frames": [asdict(f) for f in self.frames],
            "diverges_at": asdict(self.diverges_at) if self.diverges_at else None,
            "reference_at": asdict(self.reference_at) if self.reference_at else None,
        }
        if self.by_host:
            d["hosts"] = [m.host for m in self.members]
        return d


def stack_key(frames: Sequence[Frame]) -> tuple[tuple[str, str, int], ...]:
    return tuple(f.key() for f in frames)


def headline(frames: Sequence[Frame]) -> str:
    """``in all_reduce (torch/distributed/distributed_c10d.py:2806) <- main (train.py:40)``."""
    py = [f for f in frames if not f.native]
    if not py:
        return f"in {frames[0].where()}" if frames else "no frames"
    text = f"in {py[0].where()}"
    user = next((f for f in py if not is_library_path(f.file)), None)
    if user is not None and user is not py[0]:
        text += f" <- {user.where()}"
    # With native frames: the innermost C/C++ frame of the program's own libraries (a
    # collective's wait, a CUDA synchronize) says what the Python frame is blocked in.
    inner = frames[: frames.index(py[0])]
    waits = [
        f
        for f in inner
        if not os.path.basename(f.library or f.file).startswith(_SYSTEM_LIBS)
        and f.function not in ("???", "")
        and not f.function.startswith("0x")
    ]
    if waits:
        text += f" [native: {short_symbol(waits[0].function, 60)}]"
    return text


def _divergence(frames: Sequence[Frame], reference: Sequence[Frame]) -> tuple[Frame | None, Frame | None]:
    """The first frame, walking from the outermost, where ``frames`` differs from ``reference``."""
    a, b = list(reversed(frames)), list(reversed(reference))
    for i in range(max(len(a), len(b))):
        fa = a[i] if i < len(a) else None
        fb = b[i] if i < len(b) else None
        if fa is None or fb is None or fa.key() != fb.key():
            return fa, fb
    return None, None


def group_processes(processes: Iterable[ProcessStacks], by_host: bool = False) -> list[Group]:
    """Group processes by identical main-thread stack, largest group first (ties: lowest rank).
    With ``by_host`` (processes of several nodes), labels name each member's host."""
    buckets: dict[tuple[tuple[str, str, int], ...], list[ProcessStacks]] = {}
    frames_of: dict[tuple[tuple[str, str, int], ...], list[Frame]] = {}
    for p in processes:
        main = p.main_thread()
        frames = main.frames if main is not None else []
        key = stack_key(frames)
        buckets.setdefault(key, []).append(p)
        frames_of.setdefault(key, frames)

    def order(item: tuple[Any, list[ProcessStacks]]) -> tuple[int, int, int]:
        members = item[1]
        first = min(members, key=_sort_key)
        return (-len(members), first.rank if first.rank is not None else 1 << 30, first.pid)

    groups = [
        Group(members=sorted(m, key=_sort_key), frames=frames_of[k], by_host=by_host)
        for k, m in sorted(buckets.items(), key=order)
    ]
    if len(groups) > 1:
        reference = groups[0]
        for g in groups[1:]:
            g.outlier = len(g.members) < len(reference.members)
            g.diverges_at, g.reference_at = _divergence(g.frames, reference.frames)
    return groups


def _sort_key(p: ProcessStacks) -> tuple[int, int]:
    return (p.rank if p.rank is not None else 1 << 30, p.pid)


MAX_HOSTS_NAMED = 4


def rank_labels(members: Sequence[ProcessStacks], by_host: bool = False) -> str:
    """``ranks 0-6``, ``rank 7``, ``ranks 0,2,5-7``, or pids where ranks are unknown. With
    ``by_host``: ``rank 37 on node-5``, ``ranks 0-7 on node-1, ranks 8-15 on node-2``, or past
    a few hosts ``ranks 0-511 on 64 nodes``."""
    if by_host:
        hosts: dict[str, list[ProcessStacks]] = {}
        for m in members:
            hosts.setdefault(m.host or "?", []).append(m)
        if len(hosts) > MAX_HOSTS_NAMED:
            return f"{rank_labels(members)} on {len(hosts)} nodes"
        order = sorted(hosts.items(), key=lambda kv: min(_sort_key(m) for m in kv[1]))
        return ", ".join(f"{rank_labels(ms)} on {host}" for host, ms in order)
    ranks = sorted(m.rank for m in members if m.rank is not None)
    pids = sorted(m.pid for m in members if m.rank is None)
    parts = []
    if ranks:
        spans: list[list[int]] = []
        for r in ranks:
            if spans and r == spans[-1][1] + 1:
                spans[-1][1] = r
            else:
                spans.append([r, r])
        text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
        parts.append(("ranks " if len(ranks) > 1 else "rank ") + text)
    if pids:
        parts.append(("pids " if len(pids) > 1 else "pid ") + ",".join(str(p) for p in pids))
    return " + ".join(parts) or "no processes"


# -- rendering ------------------------------------------------------------------------------------
def render_process(p: ProcessStacks) -> str:
    """One process's dump: every thread, innermost frame first."""
    where = f" on {p.host}" if p.host else ""
    who = f"{p.label} (pid {p.pid}{where})" if p.rank is not None else f"pid {p.pid}{where}"
    head = f"{who} read with {p.method}{' (native frames)' if p.native else ''}"
    lines = [head]
    if p.fallback_reason:
        lines.append(f"  note: {p.fallback_reason}")
    for note in p.notes:
        lines.append(f"  note: {note}")
    for t in p.threads:
        flags = []
        if t.main:
            flags.append("main")
        if t.holds_gil:
            flags.append("holds the GIL")
        if t.active is False:
            flags.append("idle")
        name = f' "{t.name}"' if t.name else ""
        lines.append(f"Thread {t.tid}{name}" + (f" ({', '.join(flags)})" if flags else ""))
        if not t.frames:
            lines.append("    (no frames)")
        for f in t.frames:
            lines.append(f"    {f.where()}")
            for k, v in (f.locals or {}).items():
                lines.append(f"        {k} = {v}")
    return "\n".join(lines)


def render_merged(
    processes: Sequence[ProcessStacks], groups: Sequence[Group] | None = None, max_frames: int = 40
) -> str:
    groups = list(groups) if groups is not None else group_processes(processes)
    methods = sorted({p.method for p in processes})
    native = any(p.native for p in processes)
    lines = [
        f"{len(processes)} process(es), {len(groups)} group(s) by main-thread stack"
        f" (read with {', '.join(methods)}{'; native frames' if native else ''}; innermost frame first)"
    ]
    lines.append("")
    for g in groups:
        text = f"{g.labels}: {g.headline()}"
        if g.outlier:
            text += "   <- outlier"
        lines.append(text)
    lines.append("")
    several = any(g.by_host for g in groups)

    def who(p: ProcessStacks) -> str:  # "rank 3 on node-5" where the processes are of several nodes
        return f"{p.label} on {p.host}" if several and p.host else p.label

    for i, g in enumerate(groups, 1):
        gil = [who(m) for m in g.members if (m.main_thread() or ThreadStack(0)).holds_gil]
        size = f"{len(g.members)} process{'es' if len(g.members) != 1 else ''}"
        title = f"== group {i}: {g.labels} ({size}){' -- outlier' if g.outlier else ''}"
        lines.append(title)
        if gil:
            lines.append(f"   main thread holds the GIL in: {', '.join(gil)}")
        if i > 1:
            if g.diverges_at is not None or g.reference_at is not None:
                mine = g.diverges_at.where() if g.diverges_at else "(its stack ends here)"
                ref = g.reference_at.where() if g.reference_at else "(its stack ends here)"
                lines.append(f"   differs from group 1 at: {mine}")
                lines.append(f"                group 1 is at: {ref}")
        shown = g.frames[:max_frames]
        for f in shown:
            lines.append(f"    {f.where()}")
        if len(g.frames) > max_frames:
            lines.append(f"    ... {len(g.frames) - max_frames} more frames")
        if not g.frames:
            lines.append("    (no frames: the main thread was not found or runs no code)")
        lines.append("")
    notes = [f"{who(p)}: read with {p.method} because {p.fallback_reason}" for p in processes if p.fallback_reason]
    if notes:
        lines.append("Notes:")
        lines.extend(f"  {n}" for n in notes)
    return "\n".join(lines).rstrip() + "\n"


def several_hosts(processes: Sequence[ProcessStacks]) -> bool:
    """Processes of more than one node (merged answers): labels then name each rank's host."""
    return len({p.host for p in processes}) > 1


def unique_file_stems(processes: Sequence[ProcessStacks]) -> list[str]:
    """A file name per process; the same rank or pid on two nodes gets its host added."""
    stems: list[str] = []
    used: set[str] = set()
    for i, p in enumerate(processes):
        stem = process_file_stem(p)
        if stem in used:
            host = re.sub(r"[^A-Za-z0-9._-]", "_", p.host or "")[:64]
            stem = f"{stem}-{host}-{i}" if host else f"{stem}-{i}"
        used.add(stem)
        stems.append(stem)
    return stems


def merged_dict(
    processes: Sequence[ProcessStacks], groups: Sequence[Group], stems: Sequence[str] | None = None
) -> dict[str, Any]:
    return {
        "schema": SCHEMA + ".merged",
        "schema_version": SCHEMA_VERSION,
        "processes": [
            {
                "pid": p.pid,
                "rank": p.rank,
                "job": p.job,
                "host": p.host,
                "method": p.method,
                "native": p.native,
                "fallback_reason": p.fallback_reason,
                "file": stems[i] if stems is not None else process_file_stem(p),
            }
            for i, p in enumerate(processes)
        ],
        "groups": [g.to_dict() for g in groups],
    }


def process_file_stem(p: ProcessStacks) -> str:
    return (f"rank{p.rank}-" if p.rank is not None else "") + f"pid{p.pid}"


def write_request_artifact(writer: Any, processes: Sequence[ProcessStacks], failures: dict[str, str]) -> dict[str, Any]:
    """Fill an artifact writer with every process's dump and the merged view; return the summary."""
    groups = group_processes(processes, by_host=several_hosts(processes))
    stems = unique_file_stems(processes)
    for p, stem in zip(processes, stems):
        writer.write_json(f"{stem}.json", p.to_dict())
        writer.write_text(f"{stem}.txt", render_process(p) + "\n")
    merged = merged_dict(processes, groups, stems)
    merged["failures"] = failures
    writer.write_json("merged.json", merged)
    writer.write_text("merged.txt", render_merged(processes, groups))
    return {
        "processes": len(processes),
        "failed": len(failures),
        "groups": len(groups),
        "lines": [f"{g.labels}: {g.headline()}" for g in groups],
        "methods": sorted({p.method for p in processes}),
    }


MAX_PROCESSES = 100_000


def _process_from(directory: Path, name: str) -> ProcessStacks:
    from dynprof.untrusted import read_json_in

    data = read_json_in(directory, name)
    if not isinstance(data, dict):
        raise ArtifactError(f"{name} in {directory} is not a JSON object")
    try:
        return ProcessStacks.from_dict(data)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ArtifactError(f"{name} in {directory} is not a stacks dump: {type(exc).__name__}: {exc}") from None


def load_processes(directory: Path) -> list[ProcessStacks]:
    """The processes of a stacks artifact. Its files are untrusted: only plain names inside
    ``directory`` are read (an entry naming ``../x`` or ``/etc/x`` is refused), never
    through a link, with size and depth limits."""
    from dynprof.untrusted import check_name, read_json_in

    directory = Path(directory)
    if os.path.lexists(directory / "merged.json"):
        info = read_json_in(directory, "merged.json")
        entries = info.get("processes", []) if isinstance(info, dict) else None
        if not isinstance(entries, list) or len(entries) > MAX_PROCESSES:
            raise ArtifactError(f"merged.json in {directory} has no valid list of processes")
        processes = []
        for e in entries:
            stem = e.get("file") if isinstance(e, dict) else None
            if not isinstance(stem, str):
                raise ArtifactError(f"merged.json in {directory}: an entry without a file name")
            processes.append(_process_from(directory, check_name(f"{stem}.json")))
        return processes
    if os.path.lexists(directory / "stacks.json"):
        return [_process_from(directory, "stacks.json")]
    return []


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Renderer for ``dynprof show`` (kinds ``stacks`` and ``hang``)."""
    processes = load_processes(Path(artifact.path))
    groups = group_processes(processes, by_host=several_hosts(processes))
    summary: dict[str, Any] = {"processes": len(processes), "groups": [g.to_dict() for g in groups]}
    if artifact.kind == HANG_KIND:
        m = artifact.manifest.get("summary") or {}
        text = (
            f"no optimizer step for {m.get('stalled_for_s', '?')} s after step {m.get('step', '?')}"
            f" (timeout {m.get('timeout_s', '?')} s)\n\n"
        )
        text += "".join(
            f"main thread {headline(main.frames)}\n\n" for p in processes if (main := p.main_thread()) is not None
        )
        text += "\n\n".join(render_process(p) for p in processes)
        summary.update({k: m.get(k) for k in ("step", "stalled_for_s", "timeout_s", "dump")})
        return summary, text
    return summary, render_merged(processes, groups)


# -- merging the answers of several nodes ------------------------------------------------------
MAX_MERGED_FRAMES = 1024  # frames kept per main-thread stack read back
MAX_MERGED_TEXT = 2000  # characters kept per frame field, note or name read back


def _bounded_text(value: Any) -> str | None:
    return str(value)[:MAX_MERGED_TEXT] if value is not None and value != "" else None


def _bounded_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and -(1 << 62) < value < 1 << 62 else None


def _frames_from(items: Any) -> list[Frame]:
    if not isinstance(items, list):
        return []
    frames = []
    for d in items[:MAX_MERGED_FRAMES]:
        if not isinstance(d, dict):
            continue
        frames.append(
            Frame(
                function=_bounded_text(d.get("function")) or "?",
                file=_bounded_text(d.get("file")) or "",
                line=_bounded_int(d.get("line")) or 0,
                native=d.get("native") is True,
                library=_bounded_text(d.get("library")),
            )
        )
    return frames


def processes_from_result(result: Any, host: str | None = None) -> tuple[list[ProcessStacks], dict[str, str]]:
    """The processes (main thread only) and failures of one ``dynprof stacks --json`` answer:
    one node's, a fan-out's over several nodes, or an earlier merge. Untrusted input: fields of
    the wrong type are dropped, sizes bounded. ``host`` names the node where the answer does
    not (answers of dynprof versions that did not list each process's host)."""
    if not isinstance(result, dict) or not isinstance(result.get("processes"), list):
        raise ValueError("not the JSON of `dynprof stacks --json` (no list of processes)")
    rows = result["processes"]
    if len(rows) > MAX_PROCESSES:
        raise ValueError(f"{len(rows)} processes: at most {MAX_PROCESSES}")
    # Stacks listed per group (answers whose processes do not carry their main thread).
    by_member: dict[tuple[int, str | None], list[Frame]] = {}
    groups = result.get("groups")
    for g in groups[:MAX_PROCESSES] if isinstance(groups, list) else []:
        if not isinstance(g, dict):
            continue
        frames = _frames_from(g.get("frames"))
        members = g.get("members")
        if isinstance(members, list):
            keys = [
                (m.get("pid"), _bounded_text(m.get("host") or m.get("node"))) for m in members if isinstance(m, dict)
            ]
        else:
            pids = g.get("pids")
            keys = [(pid, None) for pid in pids] if isinstance(pids, list) else []
        for key_pid, node in keys[:MAX_PROCESSES]:
            member = _bounded_int(key_pid)
            if member is not None:
                by_member.setdefault((member, node), frames)
                by_member.setdefault((member, None), frames)
    processes = []
    for row in rows:
        if not isinstance(row, dict) or _bounded_int(row.get("pid")) is None:
            continue
        pid = row["pid"]
        where = _bounded_text(row.get("host")) or _bounded_text(row.get("node")) or host
        main = row.get("main_thread")
        if isinstance(main, dict):
            frames = _frames_from(main.get("frames"))
            tid = _bounded_int(main.get("tid")) or pid
            holds = main.get("holds_gil") if isinstance(main.get("holds_gil"), bool) else None
        else:
            node = _bounded_text(row.get("node")) or _bounded_text(row.get("host"))
            frames = by_member.get((pid, node)) or by_member.get((pid, None)) or []
            tid, holds = pid, None
        processes.append(
            ProcessStacks(
                pid=pid,
                method=(_bounded_text(row.get("method")) or "?")[:40],
                native=row.get("native") is True,
                rank=_bounded_int(row.get("rank")),
                job=_bounded_text(row.get("job")),
                host=where,
                threads=[ThreadStack(tid=tid, main=True, holds_gil=holds, frames=frames)],
                fallback_reason=_bounded_text(row.get("fallback_reason")),
            )
        )
    failures: dict[str, str] = {}
    found = result.get("failures")
    if isinstance(found, dict):
        for who, why in list(found.items())[:MAX_PROCESSES]:
            label = str(who)[:200]
            if host and " on " not in label:
                label += f" on {host}"
            failures[label] = str(why)[:MAX_MERGED_TEXT]
    return processes, failures


def merge_stack_processes(
    results: Sequence[Any], hosts: Sequence[str | None] | None = None
) -> tuple[list[ProcessStacks], dict[str, str], list[Group]]:
    """The processes of several ``stacks --json`` answers, each (host, pid) once, grouped over
    all of them; a result that cannot be read is a failure named by its host (or position)."""
    processes: list[ProcessStacks] = []
    failures: dict[str, str] = {}
    seen: set[tuple[str | None, int]] = set()
    for i, result in enumerate(results):
        host = hosts[i] if hosts is not None and i < len(hosts) else None
        try:
            found, failed = processes_from_result(result, host)
        except ValueError as exc:
            failures[f"answer {host or i + 1}"] = str(exc)
            continue
        failures.update(failed)
        for p in found:
            if (p.host, p.pid) in seen:
                continue  # the same answer given twice
            seen.add((p.host, p.pid))
            processes.append(p)
            if len(processes) > MAX_PROCESSES:
                raise ValueError(f"over {MAX_PROCESSES} processes in all")
    return processes, failures, group_processes(processes, by_host=several_hosts(processes))


def merged_group_dict(group: Group) -> dict[str, Any]:
    d = group.to_dict()
    d["members"] = [{"rank": m.rank, "pid": m.pid, "host": m.host} for m in group.members]
    d["odd"] = [f"{m.label} on {m.host}" if m.host else m.label for m in group.members] if group.outlier else []
    return d


def process_row(p: ProcessStacks) -> dict[str, Any]:
    """A process as ``stacks --json`` lists it, with its main thread (what a merge groups by)."""
    main = p.main_thread()
    return {
        "pid": p.pid,
        "rank": p.rank,
        "job": p.job,
        "host": p.host,
        "method": p.method,
        "native": p.native,
        "fallback_reason": p.fallback_reason,
        "main_thread": None
        if main is None
        else {
            "tid": main.tid,
            "name": main.name,
            "holds_gil": main.holds_gil,
            "frames": [{**asdict(f), "locals": None} for f in main.frames[:MAX_MERGED_FRAMES]],
        },
    }


def merge_stack_results(results: Sequence[Any], hosts: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Merge the ``dynprof stacks --json`` answers of several nodes into one grouped view.

    ``results[i]`` is one answer (a dict, untrusted); ``hosts[i]``, if given, names its node
    where the answer does not name each process's host. Returns the same shape as one node's
    ``stacks --json`` (``groups``, ``processes``, ``failures``), so a merge can be merged again;
    with processes of several hosts, group labels and ``odd`` name each rank's host
    (``rank 37 on node-5``)."""
    return merged_result(*merge_stack_processes(results, hosts))


def merged_result(
    processes: Sequence[ProcessStacks], failures: dict[str, str], groups: Sequence[Group]
) -> dict[str, Any]:
    return {
        "groups": [merged_group_dict(g) for g in groups],
        "processes": [process_row(p) for p in processes],
        "failures": failures,
        "hosts": sorted({p.host for p in processes if p.host}),
    }
