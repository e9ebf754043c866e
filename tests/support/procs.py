"""Processes a test starts and reads back through /proc."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


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


class Children:
    """Child processes of a test, each returned once its exec is done; ``close`` kills them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[Any]:
        """``argv`` with a pipe on its stdin and this environment plus ``env``."""
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, env={**os.environ, **(env or {})}, **popen)
        self.procs.append(child)
        wait_exec_done(child.pid, env)
        return child

    def close(self) -> None:
        for child in self.procs:
            child.kill()
            child.wait()


def terminate(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """End ``proc``: SIGTERM, then SIGKILL if it has not exited within ``timeout``; reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
