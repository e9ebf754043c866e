"""Reading stacks: each method gives a :class:`~collectors.stacks.model.ProcessStacks`.

* ``py-spy`` (``py-spy dump --json``): reads the target's memory from outside; works when the
  target holds the GIL in C code, runs no Python, or is stopped. Fast (~0.1 s per process).
* ``pystack`` (through ``python -m collectors.stacks._pystack_dump``, a subprocess so a crash of
  the reader never takes the CLI down): native frames merged with Python frames, GIL holder,
  core files.
* ``agent``: the dynprof agent inside the process walks ``sys._current_frames()``; needs the GIL
  and a running interpreter, but no ptrace permission.
* ``faulthandler``: the hang watchdog's GIL-free dump, parsed from faulthandler's text.

Frames are stored innermost first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collectors.stacks.model import Frame, ProcessStacks, ThreadStack
from dynprof.errors import ArtifactError


class CaptureError(Exception):
    """A method could not read the stacks; ``reason`` says why in a person's words."""

    def __init__(self, method: str, reason: str) -> None:
        super().__init__(f"{method}: {reason}")
        self.method = method
        self.reason = reason


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
    return [override or sys.executable, "-m", "collectors.stacks._pystack_dump", *args]


def capture_pystack(pid: int, native: bool = False, locals: bool = False, timeout: float = 20.0) -> ProcessStacks:
    args = ["--pid", str(pid)] + (["--native"] if native else []) + (["--locals"] if locals else [])
    t0 = time.monotonic()
    ps = _pystack_output(_run_tool(_pystack_cmd(args), "pystack", timeout))
    ps.duration_s = time.monotonic() - t0
    return ps


def _pystack_output(out: str) -> ProcessStacks:
    try:
        return ProcessStacks.from_json(json.loads(out))
    except (ValueError, RecursionError) as exc:
        raise CaptureError("pystack", f"unreadable output: {str(exc)[:200]}") from None
    except ArtifactError as exc:
        raise CaptureError("pystack", f"unreadable output: {exc.message}") from None


def capture_core(
    core: str, executable: str | None = None, native: bool = False, locals: bool = False, timeout: float = 120.0
) -> ProcessStacks:
    args = ["--core", core] + (["--executable", executable] if executable else [])
    args += (["--native"] if native else []) + (["--locals"] if locals else [])
    t0 = time.monotonic()
    ps = _pystack_output(_run_tool(_pystack_cmd(args), "pystack", timeout))
    ps.duration_s = time.monotonic() - t0
    return ps


# -- in-process readers (agent side) ------------------------------------------------------------
_PLAIN = (int, float, complex, bool, type(None), str, bytes)


def safe_repr(value: Any, depth: int = 0, budget: list[int] | None = None) -> str:
    """A local's value as text, read without running any of the job's code: built-in scalars,
    strings and bytes as ``repr`` gives them, built-in containers (a few items deep), and every
    other object as ``<TypeName>`` only.

    Why: this runs on the agent's thread while the training thread runs. ``repr`` of a tensor
    reads its storage (of a CUDA tensor: a copy to the host that waits for the GPU), and ``repr``
    of any other object runs the job's code (which may read tensors, take its locks, or last
    long). The agent's threads never touch the job's torch objects; this reads their type."""
    budget = budget if budget is not None else [200]
    if budget[0] <= 0:
        return "…"
    kind = type(value)
    if kind in _PLAIN:
        text = repr(value[:200] if isinstance(value, (str, bytes)) else value)
    elif kind in (list, tuple, set, frozenset, dict) and depth < 2:
        parts: list[str] = []
        if kind is dict:
            for k, v in list(value.items())[:8]:
                parts.append(f"{safe_repr(k, depth + 1, budget)}: {safe_repr(v, depth + 1, budget)}")
        else:
            parts = [safe_repr(item, depth + 1, budget) for item in list(value)[:8]]
        more = ", …" if len(value) > len(parts) else ""
        brackets = "[]" if kind is list else "()" if kind is tuple else "{}"
        text = f"{brackets[0]}{', '.join(parts)}{more}{brackets[1]}"
    else:
        module = getattr(kind, "__module__", "") or ""
        text = f"<{module + '.' if module not in ('builtins', '') else ''}{kind.__qualname__}>"
    budget[0] -= len(text)
    return text


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
                    loc[str(k)] = safe_repr(v)[:200]
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
