"""Errors a person can act on.

Every error dynprof raises on purpose is a :class:`DynprofError`. Each subclass carries a
``help`` text that names the concrete fix, and an ``exit_code`` that the CLI returns. Anything
else that escapes to the top is a bug and shows its traceback.

Exit codes are stable and documented in the README:

====  ======================================================
 0    success
 1    generic dynprof error (bad input, nothing matched)
 2    usage error (argparse)
 3    target process not found
 4    permission denied (other user, ptrace blocked)
 5    no agent in the target process
 6    the target is busy (a capture already running)
 7    the target lacks a capability (no torch, no CUDA, ...)
 8    the agent answered with an error / protocol failure
 9    timed out waiting for the target
10    the target is not a Python process (``dynprof stacks``)
11    reading the target's memory from outside (ptrace) was refused and no agent could answer
12    with --hosts: some node's sidecar did not answer (the others' results are still printed)
====  ======================================================
"""

from __future__ import annotations

import errno
import os


class DynprofError(Exception):
    """Base class of every error dynprof reports to a person."""

    exit_code = 1
    default_help = ""

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help if help is not None else self.default_help

    def __str__(self) -> str:
        return self.message


class UsageError(DynprofError):
    """Bad arguments that argparse could not catch."""

    exit_code = 2


class ProcessNotFound(DynprofError):
    exit_code = 3
    default_help = "Check the pid with `dynprof ps` or `ps -p PID`; the process may have exited."


class PermissionDenied(DynprofError):
    exit_code = 4
    default_help = (
        "Run dynprof as the same user as the target process, or as root. In a container, "
        "reading another process's memory needs CAP_SYS_PTRACE (docker run --cap-add=SYS_PTRACE; "
        "Kubernetes securityContext.capabilities.add: [SYS_PTRACE]) and "
        "/proc/sys/kernel/yama/ptrace_scope must be 0 or 1 (1: same user, parent only)."
    )


# What to do when the process has no NCCL flight recorder to dump (the agent's answer, and the
# CLI's when it reads the recorder itself).
FLIGHT_RECORDER_HELP = (
    "Start the job with the recorder on: `dynprof run --flight-recorder -- torchrun ...` "
    "(or set TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE=2000 in its environment). "
    "The recorder must be on before the process group is created."
)

LAUNCH_WITH_AGENT_HELP = (
    "start the job under the agent: `dynprof run -- python train.py ...` (or torchrun), "
    "or set DYNPROF=1 in the job's environment (the dynprof package must be installed in "
    "the job's Python), or call dynprof.agent.start() in the training script."
)


class NoAgent(DynprofError):
    exit_code = 5
    default_help = (
        "Attach one to the running process: `dynprof attach PID` (or `dynprof attach --job JOB`), "
        "or add --attach to this command; or " + LAUNCH_WITH_AGENT_HELP
    )


class Busy(DynprofError):
    exit_code = 6
    default_help = "Wait for the running capture to finish, or end it with `dynprof stop`."


class Unsupported(DynprofError):
    exit_code = 7


class AgentError(DynprofError):
    exit_code = 8


class Timeout(DynprofError):
    exit_code = 9


class NotPython(DynprofError):
    exit_code = 10
    default_help = "dynprof reads Python processes: point it at the training process (see `dynprof ps`)."


class PtraceRefused(PermissionDenied):
    """Reading a process from outside was refused (and no in-process agent could answer)."""

    exit_code = 11


class NodesFailed(DynprofError):
    """Some node of a command over many nodes did not answer (docs/many-nodes.md)."""

    exit_code = 12
    default_help = "Start `dynprof serve` on that node, or check its address, port, token and certificate."


class ArtifactError(DynprofError):
    exit_code = 1


class MissingFile(ArtifactError):
    """A file named inside an artifact's directory is not there."""


class StoreError(ArtifactError):
    """Writing an artifact failed (no space left, permission, ...); nothing half-written is left."""

    default_help = (
        "Free space in the artifact store (or lower DYNPROF_ARTIFACT_MAX_BYTES), or point "
        "DYNPROF_ARTIFACT_DIR at a writable filesystem with room; the next capture works once it has."
    )


def probe_pid(pid: int) -> None:
    """Raise :class:`ProcessNotFound` or :class:`PermissionDenied` unless we may signal ``pid``.

    ``kill(pid, 0)`` tells "no such process" (ESRCH) from "someone else's process" (EPERM)
    without touching the process.
    """
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}: a pid is a positive integer")
    try:
        os.kill(pid, 0)
        gone = process_gone(pid)
        if gone is not None:
            raise ProcessNotFound(f"process {pid} {gone}")
    except ProcessLookupError:
        raise ProcessNotFound(f"no process with pid {pid}") from None
    except PermissionError:
        raise PermissionDenied(
            f"process {pid} belongs to another user",
        ) from None
    except OSError as exc:  # pragma: no cover - other errno values are not expected
        if exc.errno == errno.ESRCH:
            raise ProcessNotFound(f"no process with pid {pid}") from None
        raise


def process_gone(pid: int) -> str | None:
    """Why ``pid`` is no longer a running process ("has exited", "... a zombie ..."), or None.

    A zombie still answers ``kill(pid, 0)`` but has no memory, threads or agent left to read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return "has exited"
    except OSError:
        return None
    # The state is the field after the parenthesised command name (which may hold spaces and ")").
    fields = stat[stat.rfind(b")") + 1 :].split()
    if fields and fields[0] in (b"Z", b"X"):
        return "has exited (a zombie: it waits for its parent to reap it)"
    return None
