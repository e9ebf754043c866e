"""One read of a node's live per-rank progress: what each agent says of its steps (the agent's
status request, every agent asked at once) and what the node sees of each process (its state,
CPU time and bytes read and written, its children's included: a rank whose DataLoader workers
compute is moving), and, for ranks that stepped on CUDA and then stopped stepping, what the
node's NVML says of their device (:func:`dynprof.watch.gpu_side.read_gpus`).

Nothing here runs in the training process: the agent answers a status request from its own
thread with counters it keeps anyway, so a read costs the ranks one small request each
(``scripts/bench_progress_poll.py`` measures it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from dynprof import errors, roles
from dynprof.agents import parallel
from dynprof.client import AgentClient
from dynprof.registry import AgentRecord
from dynprof.watch import gpu_side
from dynprof.watch.model import GpuStep, NodeProgress, RankProgress


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process, from one pass over ``/proc/*/stat`` (a quarter of
    the CPU time psutil's process_iter takes for it); psutil's where /proc cannot be read."""
    out: dict[int, int] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        entries = []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read(4096)
            out[int(name)] = int(stat.rsplit(b")", 1)[1].split()[1])  # the field after the state
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not such a file
            continue
    if out:
        return out
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if isinstance(ppid, int):
            out[p.pid] = ppid
    return out


def _children_of(pids: Iterable[int]) -> dict[int, list[psutil.Process]]:
    """Every live descendant of each pid, from one pass over the process table."""
    wanted = set(pids)
    by_parent: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        by_parent.setdefault(ppid, []).append(pid)
    out: dict[int, list[psutil.Process]] = {}
    for pid in wanted:
        found: list[psutil.Process] = []
        todo = list(by_parent.get(pid, []))
        while todo and len(found) < 4096:
            child = todo.pop()
            try:
                found.append(psutil.Process(child))
            except (psutil.Error, OSError):  # gone since the pass
                continue
            todo.extend(by_parent.get(child, []))
        out[pid] = found
    return out


def _cpu_seconds(process: psutil.Process) -> float | None:
    try:
        t = process.cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(t.user + t.system)


def _io_bytes(process: psutil.Process) -> int | None:
    """Bytes the process read and wrote through system calls (files, pipes, sockets: rchar +
    wchar), or None where the kernel does not say."""
    try:
        io = process.io_counters()
    except (psutil.Error, OSError, AttributeError, NotImplementedError):
        return None
    chars = getattr(io, "read_chars", None), getattr(io, "write_chars", None)
    if chars[0] is None or chars[1] is None:
        return None
    return int(chars[0]) + int(chars[1])


@dataclass(slots=True)
class ProcessFacts:
    state: str  # psutil's status, "gone", or "?" (unreadable)
    cpu_s: float | None = None  # CPU seconds, live children's included
    io_bytes: int | None = None  # bytes read and written, live children's included
    started: float | None = None  # start time (unix)


def _process_facts(pid: int, children: list[psutil.Process]) -> ProcessFacts:
    """What the node sees of a process and its live children (DataLoader workers)."""
    try:
        p = psutil.Process(pid)
        state = str(p.status())
        started = float(p.create_time())
    except psutil.NoSuchProcess:
        return ProcessFacts("gone")
    except (psutil.Error, OSError):
        return ProcessFacts("?")
    cpu = _cpu_seconds(p)
    io = _io_bytes(p)
    for child in children:
        if cpu is not None:
            more = _cpu_seconds(child)
            if more is not None:
                cpu += more
        if io is not None:
            chars = _io_bytes(child)
            if chars is not None:
                io += chars
    return ProcessFacts(state, cpu, io, started)


def _gpu_step(status: object) -> GpuStep | None:
    """The status's GPU step (an agent that recorded none, or an older agent: None), bounded."""
    g = getattr(status, "gpu_step", None)
    if g is None or not getattr(g, "recorded", False):
        return None
    return GpuStep.from_json(
        {
            "step": int(g.step),
            "done": bool(g.done),
            "age_s": float(g.age_s),
            "device": int(g.device),
            "device_uuid": str(g.device_uuid),
            "coredump_armed": bool(g.coredump_armed),
            "probe": {"done": bool(g.probe_done), "age_s": float(g.probe_age_s)} if g.probed else None,
        }
    )


def read_progress(
    records: list[AgentRecord], host: str, job: str | None = None, timeout: float = 1.0, poll_every_s: float = 0.0
) -> NodeProgress:
    """The ranks of ``job`` (every job when None) among ``records``, read now. A rank is a
    process the job's role rules call a trainer (launchers and DataLoader workers are not
    ranks); an agent that does not answer within ``timeout`` is ``unresponsive`` (its process
    may hold the GIL in C code, or be stopped) and keeps its last known identity."""
    statuses = parallel(lambda r: AgentClient.for_record(r, timeout=timeout).status(), records)
    now = time.time()
    for record, status in zip(records, statuses):
        if not isinstance(status, Exception):
            record.rank = status.rank if status.rank >= 0 else record.rank
            record.world_size = status.world_size if status.world_size >= 0 else record.world_size
            record.job_id = status.job_id or record.job_id
            record.role = status.role if status.role in roles.ROLES else record.role
    by_pid = dict(zip((r.pid for r in records), statuses))
    jobs: dict[str | None, list[AgentRecord]] = {}
    for record in records:
        jobs.setdefault(record.job_id, []).append(record)
    chosen = [r for j, members in jobs.items() if job is None or j == job for r in roles.targets(members)]
    kids = _children_of(r.pid for r in chosen)
    rows: list[RankProgress] = []
    for record in chosen:
        status = by_pid[record.pid]
        facts = _process_facts(record.pid, kids.get(record.pid, []))
        state = facts.state
        row = RankProgress(
            job=record.job_id or "",
            rank=record.rank,
            world_size=record.world_size,
            pid=record.pid,
            host=host,
            process_state=state,
            cpu_s=facts.cpu_s,
            io_bytes=facts.io_bytes,
            started_at=facts.started if facts.started is not None else record.started_at,
            polled_at=now,
        )
        if isinstance(status, Exception):
            row.agent = "gone" if state == "gone" else "unresponsive" if isinstance(status, errors.Timeout) else "error"
        else:
            row.step = int(status.step)
            row.step_time_s = float(status.step_time_s)
            if status.last_step_at > 0:
                row.last_step_at = float(status.last_step_at)
                row.last_step_age_s = max(0.0, now - row.last_step_at)
            row.gpu_step = _gpu_step(status)
        rows.append(row)
    gpu_side.read_gpus(rows)  # only ranks that stopped stepping on CUDA: NVML, guarded
    rows.sort(key=lambda r: (r.job, r.rank if r.rank is not None else 1 << 40, r.pid))
    return NodeProgress(host=host, time=now, poll_every_s=poll_every_s, ranks=rows)
