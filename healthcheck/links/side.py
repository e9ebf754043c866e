"""One node's side of a link test, under a hard time limit.

:func:`run_side` starts :mod:`healthcheck.links.worker` in a new session (a process group of
its own) and waits at most ``limit_s`` for its answer. Past it, the whole group is killed and
the side answers ``hung`` (a peer that never joined, a peer stopped, a link that dropped): the
answer comes within the limit, whatever the worker does. Nothing the worker prints is trusted:
its stdout is bounded and must be one JSON object of the expected schema.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from dynprof import errors
from dynprof.procs import kill_group
from dynprof.requests import read_options
from healthcheck.links.worker import LINK_SIDE_SCHEMA
from healthcheck.tools import start_tool

MAX_WORKER_OUTPUT = 64 * 1024
WORKER_MODULE = "healthcheck.links.worker"
BACKENDS = ("auto", "gloo", "nccl")
PATTERNS = ("sendrecv", "allreduce")


MAX_LINK_SIZE = 1024**3  # per exchange; sent in pieces of 64 MiB, so a side holds ~128 MiB at most
MIN_STORE_PORT = 1024
MAX_LIMIT_S = 900.0


@dataclass(frozen=True)
class LinkTestRequest:
    """One node's side of a link test: rank ``rank`` of ``world`` (2: a pair, 3: a ring), rank
    0's rendezvous at ``store_host:store_port``, the exchange (``backend``, ``pattern``, ``size``
    bytes, ``iters`` timed after ``warmup``), the side's hard ``limit`` (s) and the epoch second
    the timed iterations ``start_at`` (0: at once). ``bind``: where rank 0's rendezvous listens
    (None: every address); the sidecar sets it to its own address, a caller never does, so it is
    not among ``OPTIONS`` (what the sidecar's ``link-test`` action takes). Checked when made: a
    bad request raises :class:`~dynprof.errors.UsageError`.

        >>> LinkTestRequest(rank=1, world=2, store_host="gpu01").store_port
        29720
    """

    rank: int = 0
    world: int = 2
    store_host: str | None = None
    store_port: int = 29720
    backend: str = "auto"
    pattern: str = "sendrecv"
    size: int = 64 * 1024 * 1024
    iters: int = 10
    warmup: int = 2
    limit: float = 60.0
    start_at: float = 0.0
    bind: str | None = None

    OPTIONS: ClassVar[dict[str, str]] = {
        "rank": "int",
        "world": "int",
        "store_host": "str",
        "store_port": "int",
        "backend": "str",
        "pattern": "str",
        "size": "int",
        "iters": "int",
        "warmup": "int",
        "limit": "float",
        "start_at": "float",
    }

    def __post_init__(self) -> None:
        def bad(what: str) -> errors.UsageError:
            return errors.UsageError(f"link-test: {what}", help="See `dynprof link-test --help`.")

        host = self.store_host
        if not isinstance(host, str) or not host or len(host) > 255 or any(c.isspace() for c in host):
            raise bad("--store-host names rank 0's node")
        if (
            not (_whole(self.world) and _whole(self.rank))
            or self.world not in (2, 3)
            or not 0 <= self.rank < self.world
        ):
            raise bad("--world is 2 or 3 and --rank within it")
        if not _whole(self.store_port) or not MIN_STORE_PORT <= self.store_port <= 65535:
            raise bad(f"--store-port is {MIN_STORE_PORT}-65535 (no privileged port)")
        bind = self.bind
        if bind is not None and (
            not isinstance(bind, str) or not bind or len(bind) > 255 or any(c.isspace() for c in bind)
        ):
            raise bad("--bind names an address of this node")
        if self.backend not in BACKENDS:
            raise bad(f"--backend is one of {', '.join(BACKENDS)}")
        if self.pattern not in PATTERNS:
            raise bad(f"--pattern is one of {', '.join(PATTERNS)}")
        if not _whole(self.size) or not 4 <= self.size <= MAX_LINK_SIZE:
            raise bad(f"--size is 4 bytes to {MAX_LINK_SIZE >> 30} GiB")
        if (
            not (_whole(self.iters) and _whole(self.warmup))
            or not 1 <= self.iters <= 10_000
            or not 0 <= self.warmup <= 1000
        ):
            raise bad("--iters is 1-10000 and --warmup 0-1000")
        if not _finite(self.limit) or not 0 < self.limit <= MAX_LIMIT_S:
            raise bad(f"--limit is over 0 and at most {MAX_LIMIT_S:g} s")
        if not _finite(self.start_at) or self.start_at < 0 or self.start_at > time.time() + MAX_LIMIT_S:
            raise bad("--start-at is epoch seconds within --limit from now (or 0)")

    @classmethod
    def from_json(cls, doc: Any) -> LinkTestRequest:
        """The request of the sidecar's action options (``OPTIONS``, and ``bind`` the sidecar
        adds); an unknown option or a value of the wrong type is a UsageError."""
        return cls(**read_options(doc, {**cls.OPTIONS, "bind": "str"}, "link-test"))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (*self.OPTIONS, "bind")}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SideResult:
    """What one side saw: ``status`` ok, hung (killed at the limit) or failed (with why)."""

    status: str
    rank: int
    world: int
    limit_s: float
    wall_s: float
    busbw_gbps: float | None = None
    algbw_gbps: float | None = None
    bus_factor: float | None = None
    seconds: float | None = None  # the median iteration's
    backend: str | None = None
    pattern: str | None = None
    size_bytes: int | None = None
    iters: int | None = None
    interface: str | None = None
    late_s: float | None = None  # how late this side came to the round's common start
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _number(doc: dict[str, Any], key: str) -> float | None:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def run_side(
    *,
    rank: int,
    world: int,
    store_host: str,
    store_port: int,
    backend: str = "auto",
    pattern: str = "sendrecv",
    size_bytes: int = 64 * 1024 * 1024,
    iters: int = 10,
    warmup: int = 2,
    limit_s: float = 60.0,
    start_at: float = 0.0,
    bind: str | None = None,
) -> SideResult:
    """Run this node's side (rank ``rank`` of ``world``) and answer within ``limit_s``; rank 0's
    rendezvous listens on ``bind`` only (None: every address)."""
    if backend not in BACKENDS or pattern not in PATTERNS:
        raise ValueError("unknown backend or pattern")
    argv = [
        sys.executable,
        "-m",
        WORKER_MODULE,
        f"--rank={rank}",
        f"--world={world}",
        f"--store-host={store_host}",
        f"--store-port={store_port}",
        f"--backend={backend}",
        f"--pattern={pattern}",
        f"--size={size_bytes}",
        f"--iters={iters}",
        f"--warmup={warmup}",
        f"--timeout={limit_s!r}",
        f"--start-at={start_at!r}",
    ]
    if bind:
        argv.append(f"--bind={bind}")
    started = time.monotonic()
    proc = start_tool(argv)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return SideResult(
            "hung",
            rank,
            world,
            limit_s,
            time.monotonic() - started,
            error=f"the link test did not end within its limit of {limit_s:g} s; its processes were killed",
        )
    finally:
        kill_group(proc)  # whatever the worker left in its group
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        lines = [ln for ln in err[-8192:].decode("utf-8", "replace").splitlines() if ln.strip()]
        why = lines[-1][:2000] if lines else f"exit {proc.returncode}"
        return SideResult("failed", rank, world, limit_s, wall, error=why)
    try:
        doc = json.loads(out[:MAX_WORKER_OUTPUT].decode("utf-8", "replace"))
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != LINK_SIDE_SCHEMA:
        return SideResult("failed", rank, world, limit_s, wall, error="the link test wrote no answer")
    busbw = _number(doc, "busbw_gbps")
    if busbw is None:
        return SideResult("failed", rank, world, limit_s, wall, error="the link test's answer has no bandwidth")
    iters_value = doc.get("iters")
    size_value = doc.get("size_bytes")
    return SideResult(
        "ok",
        rank,
        world,
        limit_s,
        wall,
        busbw_gbps=busbw,
        algbw_gbps=_number(doc, "algbw_gbps"),
        bus_factor=_number(doc, "bus_factor"),
        seconds=_number(doc, "seconds"),
        backend=str(doc.get("backend"))[:20],
        pattern=str(doc.get("pattern"))[:20],
        size_bytes=size_value if isinstance(size_value, int) and not isinstance(size_value, bool) else None,
        iters=iters_value if isinstance(iters_value, int) and not isinstance(iters_value, bool) else None,
        interface=str(doc.get("interface"))[:40] if doc.get("interface") else None,
        late_s=_number(doc, "late_s"),
    )
