"""Start one worker process per device, enforce each check's timeout, collect the measurements.

A device that hangs inside a kernel cannot be interrupted from Python, so every check runs
in a worker process: when a check outlives its timeout the launcher kills that worker and
the check (with those after it) is "unknown", never "pass".
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof.procs import kill_group
from healthcheck.functional.measurement import Measurement
from healthcheck.functional.table import CHECKS, Scope, find

# Startup: interpreter, torch import, CUDA context.
STARTUP_TIMEOUT_S = 120.0


@dataclass
class LevelPlan:
    """The parameters and time limits of the functional checks at one level, by check name."""

    params: dict[str, dict[str, Any]]
    timeouts: dict[str, float]


def level_plan(level: str) -> LevelPlan:
    """Sizes and timeouts of the functional checks at ``level`` (``full``; any other level gets
    ``standard``'s), read from their rows."""
    at = "full" if level == "full" else "standard"
    rows = [c for c in CHECKS if at in c.levels]
    return LevelPlan(params={c.name: c.params(at) for c in rows}, timeouts={c.name: c.timeout(at) for c in rows})


@dataclass
class CheckOutcome:
    check: str
    local_rank: int
    measurements: list[Measurement] = field(default_factory=list)
    error: str | None = None  # why it did not produce a result (error, timeout, worker died)
    duration_s: float | None = None


@dataclass
class WorkerIdentity:
    local_rank: int
    pid: int | None = None
    name: str | None = None
    uuid: str | None = None


@dataclass
class _Worker:
    local_rank: int
    proc: subprocess.Popen[str]
    checks: list[str]
    stderr_path: Path
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    identity: WorkerIdentity | None = None
    current: str | None = None
    started: float = 0.0
    finished: bool = False
    outcomes: dict[str, CheckOutcome] = field(default_factory=dict)

    def stderr_tail(self, lines: int = 3) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_workers(
    local_ranks: list[int],
    checks: list[str],
    plan: LevelPlan,
    *,
    world_ranks: list[int] | None = None,
    device_type: str = "cuda",
    timeout_scale: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[CheckOutcome], list[WorkerIdentity]]:
    """Run ``checks`` on each of ``local_ranks`` (torch device ordinals), one process each.

    ``allreduce`` in ``checks`` joins all the workers in one process group.
    """
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env["WORLD_SIZE"] = str(len(local_ranks))
    env.pop("TORCHELASTIC_RUN_ID", None)
    workdir = Path(tempfile.mkdtemp(prefix="dynprof-healthcheck-"))
    params: dict[str, dict[str, Any]] = {c: dict(plan.params.get(c, {})) for c in checks}
    for c in checks:
        row = find(c)
        if row is not None and row.scope is Scope.NODE:
            # The workers' rendezvous waits as long as the check may take.
            params[c]["init_timeout_s"] = plan.timeouts.get(c, 120) * timeout_scale
    spec = {
        "checks": checks,
        "params": params,
        "device_type": device_type,
        "transfer_lock": str(workdir / "host_transfer.lock"),
    }
    workers: list[_Worker] = []
    for rank, local_rank in enumerate(local_ranks):
        stderr_path = workdir / f"worker{local_rank}.stderr"
        wenv = dict(env, LOCAL_RANK=str(local_rank), RANK=str(rank), LOCAL_WORLD_SIZE=str(len(local_ranks)))
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "healthcheck.functional.worker", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=wenv,
                start_new_session=True,
            )
        worker = _Worker(local_rank, proc, list(checks), stderr_path, started=time.monotonic(), current="startup")
        threading.Thread(target=_pump, args=(proc.stdout, worker.lines), daemon=True).start()
        workers.append(worker)
    try:
        _supervise(workers, plan, timeout_scale, progress)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                _kill(w.proc)
    outcomes = []
    for w in workers:
        for check in checks:
            outcomes.append(w.outcomes.get(check) or CheckOutcome(check, w.local_rank, error="did not run"))
    identities = [w.identity or WorkerIdentity(w.local_rank) for w in workers]
    for path in workdir.iterdir():
        path.unlink()
    workdir.rmdir()
    return outcomes, identities


def _kill(proc: subprocess.Popen[str]) -> None:
    kill_group(proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _supervise(workers: list[_Worker], plan: LevelPlan, scale: float, progress: Callable[[str], None] | None) -> None:
    while not all(w.finished for w in workers):
        for w in workers:
            if w.finished:
                continue
            _drain(w, progress)
            if w.finished:
                continue
            limit = (STARTUP_TIMEOUT_S if w.current == "startup" else plan.timeouts.get(w.current or "", 60)) * scale
            elapsed = time.monotonic() - w.started
            if w.current is not None and elapsed > limit:
                _kill(w.proc)
                _close(w, f"timed out after {limit:.0f} s in {w.current} (device hung or far too slow); worker killed")
        time.sleep(0.05)


def _drain(w: _Worker, progress: Callable[[str], None] | None) -> None:
    while True:
        try:
            line = w.lines.get_nowait()
        except queue.Empty:
            return
        if line is None:  # stdout closed: the worker exited
            w.proc.wait()
            if not w.finished:
                code = w.proc.returncode
                tail = w.stderr_tail()
                _close(w, f"worker exited with code {code} during {w.current}" + (f": {tail}" if tail else ""))
            return
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("event")
        now = time.monotonic()
        if kind == "ready":
            w.identity = WorkerIdentity(w.local_rank, event.get("pid"), event.get("name"), event.get("uuid"))
            w.current = None
        elif kind == "start":
            w.current, w.started = event["check"], now
            if progress:
                progress(f"device {w.local_rank}: {w.current}")
        elif kind == "result":
            outcome = w.outcomes.setdefault(event["check"], CheckOutcome(event["check"], w.local_rank))
            outcome.measurements.append(Measurement(**event["measurement"]))
            outcome.duration_s = now - w.started
            w.current = None
        elif kind == "error":
            w.outcomes[event["check"]] = CheckOutcome(
                event["check"], w.local_rank, error=event["message"], duration_s=now - w.started
            )
            w.current = None
        elif kind == "done":
            w.finished = True
            w.current = None


def _close(w: _Worker, why: str) -> None:
    """Mark the check in progress and every check not yet run as not done, for ``why``."""
    w.finished = True
    for check in w.checks:
        if check not in w.outcomes:
            reason = why if check == w.current else f"not run: {why}"
            w.outcomes[check] = CheckOutcome(check, w.local_rank, error=reason)
