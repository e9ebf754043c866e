"""Shared filesystems that do not answer (``--shared-fs PATH``).

Each path is probed in a child process: ``statvfs``, then a small file of dynprof's own
(``.dynprof-healthcheck-probe-HOST-PID-RANDOM``, 4 KiB) created, written, fsync'd, read back
and removed. A hung NFS or Lustre mount blocks its caller inside the system call, in D state,
where no signal reaches it and no thread can be stopped; a child process can be abandoned
(killed, never waited for), so neither the check nor the healthcheck's exit waits for it.
The child names each step before it takes it, so a step that did not return is named.

The probes start with the healthcheck and are collected at its end, each under its own limit.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof.procs import kill_group
from healthcheck.result import CheckResult, Status
from healthcheck.timeouts import did_not_return

NAME = "shared_fs"
PROBE_BYTES = 4096
_MAX_OUTPUT = 64 * 1024

# The child: one line per step it is about to take, then one JSON line with what it found.
PROBE_CODE = r"""
import errno, json, os, secrets, sys, time
path, size = sys.argv[1], int(sys.argv[2])
out = {"steps": {}}
def step(name):
    sys.stdout.write("step " + name + "\n"); sys.stdout.flush()
    return time.monotonic()
def done(name, t0):
    out["steps"][name] = round(time.monotonic() - t0, 6)
def fail(name, exc):
    out.update(failed=name, errno=errno.errorcode.get(exc.errno or 0, str(exc.errno)), error=exc.strerror or str(exc))
    sys.stdout.write(json.dumps(out) + "\n"); sys.exit(0)
try:
    t0 = step("statvfs"); st = os.statvfs(path); done("statvfs", t0)
    out.update(free_bytes=st.f_bavail * st.f_frsize, total_bytes=st.f_blocks * st.f_frsize)
except OSError as exc:
    fail("statvfs", exc)
name = os.path.join(path, ".dynprof-healthcheck-probe-%s-%d-%s" % (os.uname().nodename, os.getpid(), secrets.token_hex(4)))
data = secrets.token_bytes(size)
try:
    t0 = step("create")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600); done("create", t0)
except OSError as exc:
    fail("create", exc)
try:
    try:
        t0 = step("write"); os.write(fd, data); os.fsync(fd); done("write", t0)
    finally:
        os.close(fd)
    t0 = step("read")
    with open(name, "rb") as fh:
        back = fh.read(size + 1)
    done("read", t0)
    out["data_matches"] = back == data
except OSError as exc:
    try: os.unlink(name)
    except OSError: pass
    fail(out.get("failed") or ("read" if "write" in out["steps"] else "write"), exc)
try:
    t0 = step("unlink"); os.unlink(name); done("unlink", t0)
except OSError as exc:
    fail("unlink", exc)
sys.stdout.write(json.dumps(out) + "\n")
"""

# errno names of a filesystem that answers but will not take dynprof's probe file.
_NOT_WRITABLE = {"EROFS", "EACCES", "EPERM"}


def mount_of(path: str, mounts_text: str | None = None) -> dict[str, str] | None:
    """The mount holding ``path`` (longest mount point over it) from /proc/mounts; no system
    call touches ``path`` itself, so a hung mount cannot block this."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text(errors="replace")[: 4 * 1024 * 1024]
        except OSError:
            return None
    target = os.path.abspath(path)
    best: dict[str, str] | None = None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) > len(best["mount_point"]):
                best = {"mount_point": point, "fstype": parts[2], "source": parts[0]}
    return best


@dataclass
class SharedFsProbe:
    """One path's probe, started in a child; :meth:`result` collects it within ``limit_s``."""

    path: str
    limit_s: float
    argv: list[str] | None = None  # the child's command (tests give their own)
    started: float = 0.0
    output: bytes = b""
    proc: subprocess.Popen[bytes] | None = None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def start(self) -> SharedFsProbe:
        argv = self.argv or [sys.executable, "-I", "-S", "-c", PROBE_CODE, self.path, str(PROBE_BYTES)]
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            self.error = f"cannot start the probe: {exc.strerror or exc}"
        return self

    def _collect(self) -> bool:
        """Read the child's output until it ends or the limit passes; True if it ended."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        os.set_blocking(fd, False)
        deadline = self.started + self.limit_s
        while True:
            # Past the deadline, what the child already wrote is still read (the step it is in).
            remaining = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                if remaining <= 0:
                    return False
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                return True
            self.output = (self.output + chunk)[-_MAX_OUTPUT:]

    def _abandon(self) -> None:
        """Kill the child and do not wait for it (it may be stuck in the filesystem)."""
        assert self.proc is not None
        kill_group(self.proc)
        self.proc.poll()

    def result(self, mounts_text: str | None = None) -> CheckResult:
        mount = mount_of(self.path, mounts_text)
        details: dict[str, Any] = {"path": self.path, "limit_s": self.limit_s, "mount": mount}
        if self.proc is None:
            return CheckResult(NAME, Status.UNKNOWN, f"{self.path}: {self.error or 'not probed'}", details=details)
        ended = self._collect()
        elapsed = time.monotonic() - self.started
        lines = self.output.decode("utf-8", errors="replace").splitlines()
        steps = [line[5:] for line in lines if line.startswith("step ")]
        report: dict[str, Any] = {}
        if lines and lines[-1].startswith("{"):
            try:
                loaded = json.loads(lines[-1])
                report = loaded if isinstance(loaded, dict) else {}
            except ValueError:
                report = {}
        if not ended:
            self._abandon()
            step = steps[-1] if steps else "starting the probe"
            details["step"] = step
            return CheckResult(
                NAME,
                Status.FAIL,
                f"{self.path}: {did_not_return(step, self.limit_s)} (the filesystem does not answer)",
                value=round(elapsed, 3),
                unit="s",
                expected=f"< {self.limit_s:g} s",
                action="drain",
                details=details,
            )
        try:
            code: int | None = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._abandon()
            code = None
        details.update({k: report[k] for k in ("steps", "free_bytes", "total_bytes") if k in report})
        if not report:
            return CheckResult(
                NAME, Status.UNKNOWN, f"{self.path}: the probe ended without a report (exit {code})", details=details
            )
        failed, errname, error = report.get("failed"), str(report.get("errno", "")), str(report.get("error", ""))
        details.update({"failed": failed, "errno": errname})
        total_s = sum(float(v) for v in report.get("steps", {}).values() if isinstance(v, (int, float)))
        if failed == "statvfs":
            status = Status.UNKNOWN if errname in ("EACCES", "EPERM") else Status.FAIL
            what = "not there (not mounted?)" if errname in ("ENOENT", "ENOTDIR") else "does not answer statvfs"
            return CheckResult(
                NAME,
                status,
                f"{self.path}: {what}: {error} ({errname})",
                expected="answers",
                action="drain" if status is Status.FAIL else None,
                details=details,
            )
        if failed and errname in _NOT_WRITABLE:
            return CheckResult(
                NAME,
                Status.WARN,
                f"{self.path}: answers statvfs, but dynprof cannot write its probe file ({error}): "
                "give a writable directory on that filesystem",
                details=details,
            )
        if failed:
            return CheckResult(
                NAME,
                Status.FAIL,
                f"{self.path}: {failed} failed: {error} ({errname})",
                expected="answers",
                action="drain",
                details=details,
            )
        if report.get("data_matches") is not True:
            return CheckResult(
                NAME,
                Status.FAIL,
                f"{self.path}: the probe file read back differs from what was written",
                action="drain",
                details=details,
            )
        return CheckResult(
            NAME,
            Status.PASS,
            f"{self.path}: answers (statvfs, {PROBE_BYTES // 1024} KiB write, fsync, read, unlink in "
            f"{total_s * 1000:.0f} ms)",
            value=round(total_s * 1000, 1),
            unit="ms",
            expected=f"< {self.limit_s:g} s",
            details=details,
        )


def start_probes(paths: list[str], limit_s: float) -> list[SharedFsProbe]:
    return [SharedFsProbe(path, limit_s).start() for path in paths]
