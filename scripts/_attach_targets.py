"""Targets for the attach scripts: processes started with plain python (no dynprof)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "integration" / "programs" / "attach_program.py"

# A light target: a step loop in pure Python and an allocation-heavy second thread.
LIGHT = r"""
import os, sys, threading, time
def churn():
    while True:
        data = {i: [str(i)] * 3 for i in range(2000)}
        del data
threading.Thread(target=churn, name="churn", daemon=True).start()
gap_ms = float(sys.argv[1])
last = 0.0
i = 0
while True:
    i += 1
    sum(j * j for j in range(2000))
    time.sleep(0.005)
    now = time.perf_counter()
    if last and (now - last) * 1000 > gap_ms:
        os.write(1, ("GAP %.1f %.3f\n" % ((now - last) * 1000, time.time())).encode())
    last = now
    if i == 1:
        os.write(1, ("READY %d\n" % os.getpid()).encode())
"""


class Target:
    def __init__(self, torch: bool, gap_ms: float = 30.0, churn: bool = True) -> None:
        env = dict(os.environ)
        env.pop("DYNPROF", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        if torch:
            cmd = [
                sys.executable,
                str(PROGRAM),
                "--step-sleep",
                "0.005",
                "--gap-ms",
                str(gap_ms),
                "--max-seconds",
                "3600",
            ]
            if churn:
                cmd.append("--churn")
        else:
            cmd = [sys.executable, "-c", LIGHT, str(gap_ms)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            if line.startswith("READY"):
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180.0) -> None:
        if not self._ready.wait(timeout):
            raise SystemExit(f"target {self.pid} not ready: {self.lines[-5:]}")

    def gaps(self, since: float, until: float) -> list[float]:
        """Step gaps (ms) the target reported between two wall times."""
        out = []
        for _, line in list(self.lines):
            if line.startswith("GAP "):
                _, ms, at = line.split()
                if since <= float(at) <= until:
                    out.append(float(ms))
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
