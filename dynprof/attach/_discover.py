"""Find the processes of a job that runs without agents, from their launchers' environment.

torchrun sets ``TORCHELASTIC_RUN_ID`` in its workers, Slurm sets ``SLURM_JOB_ID`` in every
task, and ``dynprof run`` (or the user) may set ``DYNPROF_JOB_ID``. Only this user's Python
processes are read (``/proc/PID/environ`` needs the same permission as ptrace); the CLI itself
and its ancestors (a shell inside the allocation) are left out, and so are what
``dynprof.roles`` takes for launchers (torchrun, accelerate launch, a wrapper running the script
as a child) and DataLoader workers (children that multiprocessing started), and helpers when
the job has processes that know their rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dynprof import roles
from dynprof.attach._elf import python_version
from dynprof.identity import detect

JOB_VARIABLES = ("DYNPROF_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "DYNPROF_RANK")


@dataclass
class JobProcess:
    pid: int
    ppid: int
    matched: str  # the variable that named the job
    rank: int | None
    cmdline: list[str] = field(default_factory=list)
    has_rank_variable: bool = False
    role: str = roles.OTHER  # a guess from /proc (dynprof.roles.role_from_proc)

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "no rank"
        return f"pid {self.pid} ({who}, {self.matched}): {' '.join(self.cmdline)[:80]}"


@dataclass
class JobSearch:
    job: str
    found: list[JobProcess]
    skipped: list[tuple[JobProcess, str]]


def _read_environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _ppid(pid: int) -> int:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return int(data[data.rfind(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        pid = _ppid(pid)
    return out


def find_job_processes(job: str, proc: Path = Path("/proc")) -> JobSearch:
    uid = os.getuid()
    mine = _ancestors(os.getpid())
    candidates: list[JobProcess] = []
    environs: dict[int, dict[str, str]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in mine:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        env = _read_environ(pid)
        if env is None:
            continue
        matched = next((name for name in JOB_VARIABLES if env.get(name) == job), None)
        if matched is None or python_version(pid) is None:
            continue
        try:
            cmdline = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        environs[pid] = env
        candidates.append(
            JobProcess(
                pid=pid,
                ppid=_ppid(pid),
                matched=matched,
                rank=detect(env).rank,
                cmdline=cmdline,
                has_rank_variable=any(name in env for name in RANK_VARIABLES),
            )
        )
    by_pid = {p.pid: p for p in candidates}
    for p in candidates:
        parent = by_pid.get(p.ppid)
        p.role = roles.role_from_proc(
            p.cmdline, environs[p.pid], (parent.cmdline, environs[parent.pid]) if parent is not None else None
        )
    # A process of the job whose child (not a worker) is of the job too runs the script as a
    # child: a launcher (a Python wrapper, accelerate's simple launcher).
    parents = {
        p.ppid
        for p in candidates
        if p.role != roles.WORKER
        and not _same_rank_child(p, by_pid)
        and not roles.is_multiprocessing_service(p.cmdline)
    }
    found: list[JobProcess] = []
    skipped: list[tuple[JobProcess, str]] = []
    ranked = any(p.has_rank_variable for p in candidates)
    for p in sorted(candidates, key=lambda p: (p.rank if p.rank is not None else -1, p.pid)):
        if roles.is_multiprocessing_service(p.cmdline):
            skipped.append((p, "a multiprocessing helper"))
        elif p.role == roles.WORKER:
            skipped.append((p, f"started by multiprocessing in process {p.ppid} of the job (a DataLoader worker)"))
        elif p.role == roles.LAUNCHER:
            skipped.append((p, "a launcher"))
        elif ranked and not p.has_rank_variable:
            skipped.append((p, "no RANK: a launcher"))
        elif _same_rank_child(p, by_pid):
            skipped.append((p, f"a child of rank {p.rank}'s process {p.ppid} (a data-loader worker?)"))
        elif p.pid in parents:
            p.role = roles.LAUNCHER
            skipped.append((p, "a launcher: it runs a process of the job as its child"))
        else:
            found.append(p)
    return JobSearch(job, found, skipped)


def _same_rank_child(p: JobProcess, by_pid: dict[int, JobProcess]) -> bool:
    parent = by_pid.get(p.ppid)
    return parent is not None and parent.rank == p.rank and parent.has_rank_variable
