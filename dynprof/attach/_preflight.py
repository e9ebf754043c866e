"""Checks made before touching a target, each failing with the error a person can act on."""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from dynprof import errors
from dynprof.attach._elf import python_version, resolve

CAP_SYS_PTRACE = 19
MIN_PYTHON = (3, 10)
REMOTE_EXEC_PYTHON = (3, 14)

# C functions the gdb method calls in the target.
GDB_SYMBOLS = ("mmap", "Py_AddPendingCall", "PyRun_SimpleString", "PyGILState_Ensure", "PyGILState_Release")

PTRACE_HELP = (
    "attach needs ptrace permission on the target (as py-spy and gdb do): the same user, and "
    "kernel.yama.ptrace_scope 0 (or 1 with CAP_SYS_PTRACE). Check it with `sysctl kernel.yama.ptrace_scope`; "
    "allow it with `sudo sysctl -w kernel.yama.ptrace_scope=0` (2: only root may attach; 3: nobody until "
    "reboot). In a container add the capability: `docker run --cap-add=SYS_PTRACE`, or in Kubernetes "
    "`securityContext: {capabilities: {add: [SYS_PTRACE]}}`. A process that made itself non-dumpable "
    "(prctl PR_SET_DUMPABLE 0) can be attached only with CAP_SYS_PTRACE."
)


def ptrace_scope() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << CAP_SYS_PTRACE))
    except (OSError, ValueError, IndexError):
        pass
    return False


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_process(pid: int) -> None:
    """Exists, is ours, and may be ptraced by us (3, 4 or 11 otherwise)."""
    errors.probe_pid(pid)
    if exited(pid):
        raise errors.ProcessNotFound(f"process {pid} has exited (a zombie, not yet reaped by its parent)")
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        raise errors.ProcessNotFound(f"no process with pid {pid}") from None
    if owner != os.getuid():
        raise errors.PermissionDenied(
            f"process {pid} belongs to user {_user(owner)}, not to you ({_user(os.getuid())})",
            help=f"The agent's socket and records belong to the job's user: run `sudo -u {_user(owner)} dynprof "
            f"attach {pid}` (and the later commands) as that user.",
        )
    try:
        os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
    except FileNotFoundError:
        raise errors.ProcessNotFound(f"process {pid} exited") from None
    except PermissionError as exc:
        scope = ptrace_scope()
        detail = f"kernel.yama.ptrace_scope={scope}" if scope is not None else "no Yama ptrace_scope"
        cap = "with" if has_cap_sys_ptrace() else "without"
        raise errors.PtraceRefused(
            f"ptrace of process {pid} was refused ({exc.strerror}; {detail}, {cap} CAP_SYS_PTRACE)",
            help=PTRACE_HELP,
        ) from None


def target_python(pid: int) -> tuple[int, int]:
    """The CPython version of ``pid``; :class:`~dynprof.errors.NotPython` if it runs none."""
    version = python_version(pid)
    if version is None:
        try:
            symbols = resolve(pid, ["Py_AddPendingCall", "Py_Version"])
        except OSError:
            symbols = {}
        if "Py_AddPendingCall" not in symbols:
            raise errors.NotPython(
                f"process {pid} ({_comm(pid)}) does not run CPython: no libpython or python executable "
                "exporting Py_AddPendingCall is mapped",
                help="Attach to the Python training process itself (see `ps` or `dynprof stacks --job`), "
                "not to a launcher script or a shell.",
            )
        raise errors.NotPython(
            f"cannot tell which Python version process {pid} ({_comm(pid)}) runs",
            help="Start the job under `dynprof run` instead.",
        )
    if version < MIN_PYTHON:
        raise errors.Unsupported(
            f"process {pid} runs Python {version[0]}.{version[1]}; dynprof needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer"
        )
    return version


def gdb_symbols(pid: int) -> dict[str, int]:
    try:
        found = resolve(pid, GDB_SYMBOLS)
    except FileNotFoundError:
        raise errors.ProcessNotFound(f"process {pid} exited") from None
    except OSError as exc:
        raise errors.PtraceRefused(f"cannot read process {pid}'s memory map: {exc}", help=PTRACE_HELP) from None
    missing = [s for s in GDB_SYMBOLS if s not in found]
    if missing:
        raise errors.NotPython(
            f"process {pid} ({_comm(pid)}) lacks the C functions attach calls: {', '.join(missing)}",
            help="attach works with CPython builds that export their C API (every python.org, Debian, "
            "conda and uv build does). Start this job under `dynprof run` instead.",
        )
    return found


def find_gdb() -> str:
    gdb = shutil.which("gdb")
    if gdb is None:
        raise errors.DynprofError(
            "gdb is not on PATH; attaching to a Python < 3.14 process needs it",
            help="Install it (`apt-get install gdb`, `dnf install gdb`, `conda install -c conda-forge gdb`), "
            "or put a gdb on PATH. Python 3.14+ targets need no gdb (sys.remote_exec), when dynprof runs "
            "under the same Python version.",
        )
    return gdb


def remote_debug_disabled(pid: int) -> str | None:
    """Why a 3.14+ target refuses ``sys.remote_exec``, or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"PYTHON_DISABLE_REMOTE_DEBUG=") and item.split(b"=", 1)[1]:
            return "it runs with PYTHON_DISABLE_REMOTE_DEBUG set"
    for i, arg in enumerate(cmdline):
        if arg in (b"-Xdisable-remote-debug", b"-Xdisable_remote_debug") or (
            arg == b"-X"
            and i + 1 < len(cmdline)
            and cmdline[i + 1] in (b"disable-remote-debug", b"disable_remote_debug")
        ):
            return "it runs with -X disable-remote-debug"
    return None


def exited(pid: int) -> bool:
    """Gone, or a zombie (dead, waiting for its parent to reap it)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    state = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
    return state in (b"Z", b"X", b"x")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
