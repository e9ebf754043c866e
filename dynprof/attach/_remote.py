"""The Python 3.14+ transport: ``sys.remote_exec(pid, script)``.

CPython runs the script on the target's main thread at its next eval-breaker check, the same
safe point as the gdb method's pending call, with no debugger involved. It needs the same
permission as ptrace, and the same major.minor version on both sides; a target started with
``PYTHON_DISABLE_REMOTE_DEBUG`` or ``-X disable-remote-debug`` refuses it.
"""

from __future__ import annotations

import sys
from typing import Any

from dynprof import errors
from dynprof.attach._preflight import PTRACE_HELP


def available_for(version: tuple[int, int]) -> str | None:
    """Why this interpreter cannot use remote_exec on a target of ``version``, or None if it can."""
    if version < (3, 14):
        return f"the target runs Python {version[0]}.{version[1]} (sys.remote_exec needs 3.14+)"
    if not hasattr(sys, "remote_exec"):
        return f"dynprof runs under Python {sys.version_info[0]}.{sys.version_info[1]}, which has no sys.remote_exec"
    if tuple(sys.version_info[:2]) != version:
        return (
            f"dynprof runs under Python {sys.version_info[0]}.{sys.version_info[1]} and the target under "
            f"{version[0]}.{version[1]}; sys.remote_exec needs the same version on both sides"
        )
    return None


def remote_exec(pid: int, script: str) -> None:
    fn: Any = getattr(sys, "remote_exec", None)
    if fn is None:  # pragma: no cover - guarded by available_for
        raise errors.Unsupported("this Python has no sys.remote_exec")
    try:
        fn(pid, script)
    except ProcessLookupError:
        raise errors.ProcessNotFound(f"process {pid} exited during attach") from None
    except PermissionError as exc:
        raise errors.PtraceRefused(f"sys.remote_exec into process {pid} was refused: {exc}", help=PTRACE_HELP) from None
    except (RuntimeError, OSError) as exc:
        raise errors.DynprofError(
            f"sys.remote_exec into process {pid} failed: {exc}",
            help="If the target disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG, -X disable-remote-debug), "
            "use --method gdb, which does not depend on that setting.",
        ) from None
