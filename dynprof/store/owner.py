"""Which process writes: what the name of an artifact's temporary directory records of its
writer (``PID@PIDNS``); whether a writer of this host and pid namespace still runs is
:func:`dynprof.registry.pid_alive`."""

from __future__ import annotations

import os


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """``PID@PIDNS`` of this process: what a temporary directory's name records of its writer."""
    return f"{os.getpid()}@{pid_namespace()}"
