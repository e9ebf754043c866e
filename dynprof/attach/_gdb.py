"""The gdb transport: queue a pending call, or (fallback) run under PyGILState_Ensure.

gdb attaches with no symbol files at all (``--readnever``, ``auto-solib-add off``, no
libthread_db): the functions it calls are given as absolute addresses found by
:mod:`dynprof.attach._elf`, so the target stays stopped for a fraction of a second instead of
the seconds that loading libtorch's symbols takes. In whatever thread gdb stopped, only
async-signal-safe work happens: ``mmap`` a private page, write the payload there with gdb's
``restore`` (no call into the target's malloc), ``Py_AddPendingCall(PyRun_SimpleString, page)``.
No breakpoint is planted, so nothing is left behind if gdb dies. The page (a few KiB) stays
mapped: the pending call reads it later.

gdb writes the thread's extended register state (XSAVE) back after every call it makes. Where
gdb and the CPU and kernel disagree on that area's size, the kernel refuses the write (EFAULT,
"Couldn't write extended state status: Bad address") after the call ran, and the thread keeps
whatever the callee left in its vector registers. So on x86 every session first makes that same
write with nothing run (an MXCSR status bit flipped and flipped back) and calls nothing in the
target when it fails.
"""

from __future__ import annotations

import platform
import re
import signal
import subprocess
from dataclasses import dataclass

from dynprof import errors
from dynprof.attach._preflight import PTRACE_HELP, exited

PROT_READ_WRITE = 0x3
MAP_PRIVATE_ANONYMOUS = 0x22
PAGE = 4096
GIL_UNLOCKED = 1  # PyGILState_UNLOCKED: the calling thread did not hold the GIL

_SIGNATURES = {
    "mmap": "void *(*)(void *, unsigned long, int, int, int, long)",
    "Py_AddPendingCall": "int (*)(void *, void *)",
    "PyRun_SimpleString": "int (*)(char *)",
    "PyGILState_Ensure": "int (*)(void)",
    "PyGILState_Release": "void (*)(int)",
}
_VALUE = re.compile(r"^\$\d+ = (.*)$", re.M)
# The register-write probe: $dynprof_regs is 1 only when both writes went through.
_PROBE = [
    "set $dynprof_regs = 0",
    "set $dynprof_regs = (($mxcsr = $mxcsr ^ 1), ($mxcsr = $mxcsr ^ 1), 1)",
    "p $dynprof_regs",
]
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


# Every call is guarded by the probe's result, so a session whose probe failed calls nothing.
_IF_OK = "$dynprof_regs == 1 ? " if _X86 else "1 ? "


class RegistersRefused(errors.Unsupported):
    """gdb cannot write this process's registers here: it calls nothing in it."""

    def __init__(self, pid: int, output: str) -> None:
        said = next(
            (line.strip() for line in output.splitlines() if "extended state" in line or "registers" in line.lower()),
            _tail(output, 3),
        )
        super().__init__(
            f"gdb cannot write the registers of process {pid} on this machine, so it cannot call a function in "
            f"it; nothing was run in the process (gdb said: {said})",
            help="This gdb and this CPU and kernel disagree on the size of the extended register state (XSAVE), "
            "as on some recent CPUs: a newer gdb may know the layout (put it first on PATH). Without a debugger: "
            "start the job with the agent (`dynprof run -- CMD`, or DYNPROF=1 in its environment). "
            f"`dynprof stacks --pid {pid}` works here: it only reads memory.",
        )
        self.said = said


@dataclass
class GdbRun:
    output: str
    values: list[str]


class GdbSession:
    def __init__(self, gdb: str, pid: int, symbols: dict[str, int], timeout: float = 120.0) -> None:
        self.gdb = gdb
        self.pid = pid
        self.symbols = symbols
        self.timeout = timeout

    def fn(self, name: str) -> str:
        return f"(({_SIGNATURES[name]}) 0x{self.symbols[name]:x})"

    def run(self, commands: list[str]) -> GdbRun:
        cmd = [
            self.gdb,
            "--readnever",
            "-q",
            "-batch",
            "-nx",
            "-p",
            str(self.pid),
            # The target is stopped from attach to detach: read as little as possible.
            "-iex",
            "set auto-solib-add off",
            "-iex",
            "set libthread-db-search-path /nonexistent",
            "-iex",
            "set auto-load off",
            "-iex",
            "set debuginfod enabled off",
            "-ex",
            "set pagination off",
            "-ex",
            "set confirm off",
            "-ex",
            "set unwindonsignal on",
        ]
        for command in (_PROBE if _X86 else []) + commands:
            cmd += ["-ex", command]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            # Never SIGKILL gdb in the middle of a call into the target: the target would
            # return into gdb's dummy frame and die of SIGTRAP. SIGINT makes gdb interrupt the
            # call and, with unwindonsignal on, restore the thread as it was before; then it
            # detaches.
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise errors.Timeout(
                f"gdb did not finish within {self.timeout:g} s while attached to process {self.pid}; "
                "it was interrupted and detached",
                help=f"Check the process with `dynprof stacks --pid {self.pid} --native`.",
            ) from None
        out = stdout + stderr
        if exited(self.pid):
            raise errors.ProcessNotFound(f"process {self.pid} exited during attach")
        if "ptrace: Operation not permitted" in out:
            raise errors.PtraceRefused(f"gdb was not allowed to ptrace process {self.pid}", help=PTRACE_HELP)
        if "ptrace: No such process" in out or ("No such process" in out and not _VALUE.search(out)):
            raise errors.ProcessNotFound(f"process {self.pid} exited during attach")
        values = _VALUE.findall(out)
        if _X86 and values:  # no value at all: gdb failed before the probe; the caller says so
            if values[0].strip() != "1":
                raise RegistersRefused(self.pid, out)
            values = values[1:]
        return GdbRun(out, values)

    def queue_pending_call(self, payload_file: str, size: int) -> int:
        """Write the payload into a fresh page and queue ``PyRun_SimpleString(page)``; the page's address."""
        length = (size + PAGE) // PAGE * PAGE
        result = self.run(
            [
                f"p $buf = {_IF_OK}(char *) {self.fn('mmap')}(0, {length}, {PROT_READ_WRITE}, "
                f"{MAP_PRIVATE_ANONYMOUS}, -1, 0) : (char *) 0",
                f"restore {payload_file} binary $buf",
                f"p {_IF_OK}{self.fn('Py_AddPendingCall')}((void *) {self.fn('PyRun_SimpleString')}, $buf) : -98",
            ]
        )
        if len(result.values) < 2:
            raise errors.DynprofError(
                f"gdb could not queue the bootstrap in process {self.pid}",
                help="gdb said:\n" + _tail(result.output),
            )
        found = re.search(r"0x[0-9a-f]+", result.values[0])
        if found is None or int(found.group(0), 16) in (0, 2**64 - 1):
            raise errors.DynprofError(f"mmap failed in process {self.pid}: {result.values[0]}")
        if result.values[1].strip() != "0":
            raise errors.Busy(
                f"Py_AddPendingCall failed in process {self.pid} ({result.values[1].strip()}): "
                "CPython's pending-call queue is full",
                help="Try again in a moment.",
            )
        return int(found.group(0), 16)

    def run_under_gil_state(self, buffer: int) -> bool:
        """Run the payload at ``buffer`` on the main thread under PyGILState_Ensure/Release.

        Only for a main thread parked in C with the GIL released; returns False (and runs
        nothing) if that thread turned out to hold the GIL when gdb stopped it.
        """
        result = self.run(
            [
                "thread 1",
                f"p $g = {_IF_OK}{self.fn('PyGILState_Ensure')}() : -97",
                f"p $g == {GIL_UNLOCKED} ? {self.fn('PyRun_SimpleString')}((char *) 0x{buffer:x}) : -99",
                f"p $g != -97 ? ({self.fn('PyGILState_Release')}($g), 1) : 0",
            ]
        )
        if len(result.values) < 2:
            raise errors.DynprofError(
                f"gdb could not run the bootstrap in process {self.pid}", help="gdb said:\n" + _tail(result.output)
            )
        return result.values[1].strip() != "-99"


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
