"""What a process of a job is: a trainer, a launcher, a DataLoader worker, or another process.

The one place that decides. Inside a process (the agent), from what the process itself knows:

- ``trainer``: it stepped an optimizer (whatever else it is), or it knows its rank (RANK,
  SLURM_PROCID..., or torch.distributed; a ``torch.multiprocessing.spawn`` rank by its target)
  and is neither of the next two;
- ``worker``: a DataLoader worker (``torch.utils.data.get_worker_info()`` is set, the process
  was started by multiprocessing with torch's ``_worker_loop`` as its target, or its main
  thread runs ``_worker_loop``);
- ``launcher``: it never stepped, and it is a known launcher (torchrun, ``torch.distributed.launch``,
  ``accelerate launch``, ``deepspeed``) or it has children of the same job with agents (a Python
  wrapper running the training script as a child, ``torch.multiprocessing.spawn``'s parent; a
  helper that multiprocessing started and that knows no rank does not count);
- ``other``: none of these yet (a trainer before its first step, or a helper process).

Outside a process (``dynprof attach --job`` of processes without an agent) the same roles are
guessed from ``/proc/PID/cmdline`` and ``environ`` (see :func:`role_from_proc`).

A role changes over a life: a wrapper becomes a launcher once a child agent of its job appears;
any process becomes a trainer at its first optimizer step. Users target trainers: ``--job``
selects them, ``dynprof ps`` shows every role, ``attach --job`` skips workers and launchers, and
the hang watchdog does not wait for a first step in launchers and workers, nor in a spawned
child whose role is not known yet (:func:`role_pending`: it has not reached its target).

Nothing here imports torch or touches the network.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

TRAINER = "trainer"
LAUNCHER = "launcher"
WORKER = "worker"
OTHER = "other"
ROLES = (TRAINER, LAUNCHER, WORKER, OTHER)

# The interpreter argument that multiprocessing's spawn start method gives its children.
MP_CHILD_FLAG = "--multiprocessing-fork"
_WORKER_MODULE = "torch.utils.data._utils.worker"
_WORKER_FUNCTION = "_worker_loop"
_WORKER_FILE = os.path.join("torch", "utils", "data", "_utils", "worker.py")
# Launchers run as `python -m MODULE` or as a console script of that name.
_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "accelerate.commands.accelerate_cli",
    "deepspeed.launcher.runner",
    "deepspeed.launcher.launch",
)
_LAUNCHER_SCRIPTS = {"torchrun": None, "deepspeed": None, "accelerate": "launch"}


def is_launcher_cmdline(argv: Sequence[str]) -> bool:
    """A command line of a known launcher (torchrun, accelerate launch, deepspeed...)."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1] in _LAUNCHER_MODULES:
            return args[i + 1] != "accelerate.commands.accelerate_cli" or "launch" in args[i + 2 : i + 3]
    # the console script: `/venv/bin/torchrun ...` runs as `python /venv/bin/torchrun ...`
    for i, arg in enumerate(args[:3]):
        name = os.path.basename(arg)
        if name in _LAUNCHER_SCRIPTS and (i > 0 or not name.startswith("python")):
            sub = _LAUNCHER_SCRIPTS[name]
            return sub is None or sub in args[i + 1 : i + 2]
    return False


def is_mp_child_cmdline(argv: Sequence[str]) -> bool:
    """Started by multiprocessing's spawn method (a DataLoader worker, an mp.spawn rank, a helper)."""
    return MP_CHILD_FLAG in argv


def is_dataloader_target(target: Any) -> bool:
    """``target`` is torch's DataLoader worker loop (a multiprocessing Process target)."""
    return getattr(target, "__module__", None) == _WORKER_MODULE and getattr(target, "__name__", None) == (
        _WORKER_FUNCTION
    )


def is_mp_spawn_rank_target(target: Any) -> bool:
    """``target`` is the wrapper ``torch.multiprocessing.spawn`` runs each rank in."""
    return getattr(target, "__module__", None) == "torch.multiprocessing.spawn" and (
        getattr(target, "__name__", None) == "_wrap"
    )


def _current_target() -> Any:
    process = sys.modules.get("multiprocessing.process")
    return getattr(getattr(process, "_current_process", None), "_target", None)


def in_dataloader_worker() -> bool:
    """This process is a DataLoader worker (read from torch's and multiprocessing's own state)."""
    try:
        worker = sys.modules.get(_WORKER_MODULE)
        if worker is not None and getattr(worker, "_worker_info", None) is not None:
            return True  # what torch.utils.data.get_worker_info() returns
        if is_dataloader_target(_current_target()):
            return True
        import threading

        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        depth = 0
        while frame is not None and depth < 200:
            code = frame.f_code
            if code.co_name == _WORKER_FUNCTION and code.co_filename.endswith(_WORKER_FILE):
                return True
            frame, depth = frame.f_back, depth + 1
    except Exception:
        return False
    return False


class _Record(Protocol):
    pid: int
    ppid: int
    rank: int | None
    job_id: str | None
    role: str | None
    cmdline: list[str]


def decide(
    *,
    stepped: bool,
    worker: Callable[[], bool],
    launcher_cmdline: bool,
    has_agent_children: Callable[[], bool],
    rank: int | None,
    mp_child: bool,
) -> str:
    """The role from the facts a process knows, in order of precedence (cheapest first). A
    rank read from the environment makes a trainer only of a process that multiprocessing did
    not start: a helper spawned by rank 0 inherits RANK=0 (an ``mp.spawn`` rank is a trainer
    from its first step)."""
    if stepped:
        return TRAINER
    if worker():
        return WORKER
    if launcher_cmdline or has_agent_children():
        return LAUNCHER
    return TRAINER if rank is not None and not mp_child else OTHER


def role_pending(argv: Sequence[str] | None = None) -> bool:
    """This process's role is not known yet: multiprocessing's spawn method started it and it
    does not run its target yet (it still imports its parent's main module, which takes
    seconds on a loaded machine). Only the target tells a DataLoader worker from a
    ``torch.multiprocessing.spawn`` rank or a helper; multiprocessing sets the parent process
    as it starts the target. Never raises."""
    try:
        argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
        if not is_mp_child_cmdline(argv):
            return False
        process = sys.modules.get("multiprocessing.process")
        return process is None or getattr(process, "_parent_process", None) is None
    except Exception:
        return False


def _started_by_multiprocessing(argv: Sequence[str]) -> bool:
    if is_mp_child_cmdline(argv):
        return True
    process = sys.modules.get("multiprocessing.process")
    return getattr(process, "_parent_process", None) is not None


def own_role(
    stepped: bool,
    rank: int | None,
    job_id: str | None,
    has_agent_children: Callable[[], bool],
    argv: Sequence[str] | None = None,
) -> str:
    """This process's role (called by its agent; never raises). ``has_agent_children`` tells
    whether a live agent of the job is a child that makes this process a launcher (see
    :func:`dynprof.registry.has_agent_children`); it is asked last, only when needed."""
    try:
        argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
        mp_child = _started_by_multiprocessing(argv)
        # A rank of torch.multiprocessing.spawn is one before it sets RANK, if it ever does.
        spawn_rank = mp_child and is_mp_spawn_rank_target(_current_target())
        return decide(
            stepped=stepped,
            worker=in_dataloader_worker,
            launcher_cmdline=is_launcher_cmdline(argv),
            has_agent_children=has_agent_children,
            rank=-1 if rank is None and spawn_rank else rank,
            mp_child=mp_child and not spawn_rank,
        )
    except Exception:
        return OTHER


def makes_launcher(child: _Record, parent_rank: int | None) -> bool:
    """``child``, a process of its parent's job with an agent, makes its parent a launcher: it
    is no DataLoader worker, nor a helper of the parent's rank (which inherits that RANK), nor
    a helper that multiprocessing started and that knows no rank (a trainer's side process)."""
    if child.role == WORKER or (child.rank is not None and child.rank == parent_rank):
        return False
    helper = child.role in (None, OTHER) and child.rank is None and is_mp_child_cmdline(child.cmdline)
    return not helper


def job_roles(records: Sequence[_Record]) -> dict[int, str]:
    """The role of each record's process (pid -> role) as its agent reported it. One that said
    ``other``, or nothing (an older agent), and has children of its job with agents is a
    launcher; one that said nothing is a trainer if it knows a rank its parent does not share."""
    by_pid = {r.pid: r for r in records}
    parents = {(r.ppid, r.job_id) for r in records if r.ppid in by_pid and makes_launcher(r, by_pid[r.ppid].rank)}
    out: dict[int, str] = {}
    for r in records:
        role = r.role if r.role in ROLES else None
        if role in (None, OTHER) and (r.pid, r.job_id) in parents:
            role = LAUNCHER
        elif role is None:
            parent = by_pid.get(r.ppid)
            own_rank = r.rank is not None and (parent is None or parent.rank != r.rank)
            role = TRAINER if own_rank else OTHER
        out[r.pid] = role
    return out


def targets(records: Sequence[_Record]) -> list[Any]:
    """The processes users mean by a job: its trainers or, where no process is known to train
    yet, those that are neither launchers nor DataLoader workers."""
    roles = job_roles(records)
    trainers = [r for r in records if roles[r.pid] == TRAINER]
    return trainers or [r for r in records if roles[r.pid] == OTHER]


def role_from_proc(
    cmdline: Sequence[str], env: Mapping[str, str], parent: tuple[Sequence[str], Mapping[str, str]] | None
) -> str:
    """A guess at the role of a process without an agent, from its command line and environment
    (and its parent's, when the parent is a process of the same job).

    A process started by multiprocessing (spawn's ``--multiprocessing-fork``, or fork's copy of its
    parent's command line) whose parent belongs to the job is taken for a DataLoader worker: its
    command line cannot tell it from a ``torch.multiprocessing.spawn`` rank, and attaching to a
    worker costs more than missing such a rank (attach it by pid)."""
    if is_launcher_cmdline(cmdline):
        return LAUNCHER
    if parent is not None:
        parent_cmdline, _parent_env = parent
        if is_mp_child_cmdline(cmdline) or list(cmdline) == list(parent_cmdline):
            return WORKER
    from dynprof.identity import detect

    return TRAINER if detect(env).rank is not None else OTHER


# Helper interpreters that multiprocessing starts for itself: never training processes.
_SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def is_multiprocessing_service(argv: list[str] | None = None) -> bool:
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    return "-c" in argv and any(service in arg for arg in argv for service in _SERVICES)
