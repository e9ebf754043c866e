"""Ending a child process together with the processes it started.

dynprof starts its children (a healthcheck's workers, srun, a probe of a shared filesystem, a
link test's side, a sidecar action) with ``start_new_session=True``: each leads a process group
of its own, so that what it starts in turn can be ended with it, by signalling the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Any


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to the process group that ``proc`` leads; whether it was sent.

    A group that is gone (``ProcessLookupError``) or not ours to signal (``PermissionError``)
    is no error: nothing is sent. A child already reaped is no reason not to send: processes it
    left behind in its group still hold the group's id (the kernel does not give a pid in use as
    a group's id to another process), and they get the signal. The child itself is not reaped
    here: its caller waits for it."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> int | None:
    """Ask ``proc``'s process group to stop (``SIGTERM``), wait up to ``grace_s`` for ``proc``
    to end, then kill the group (``SIGKILL``) and wait up to ``grace_s`` more. Returns ``proc``'s
    exit status, reaped, or None when it still runs (stuck in the kernel) or is out of reach."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not kill_group(proc, sig):
            return proc.poll()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=grace_s)
    return proc.poll()
