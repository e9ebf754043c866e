"""Processes a test starts and reads back through /proc."""

from __future__ import annotations

import time
from pathlib import Path


def wait_exec_done(pid: int, env: dict[str, str] | None) -> None:
    """Wait until ``pid``'s new command line and environment can be read from /proc: the exec
    that Popen waited for closes its error pipe a moment before the kernel sets them up."""
    wanted = [f"{k}={v}".encode() for k, v in (env or {}).items()]
    for _ in range(500):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            environ, cmdline = [], b""
        if cmdline and all(w in environ for w in wanted):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not finish its exec")
