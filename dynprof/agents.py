"""The agents on this node, asked many at once: their records brought up to date from what each
agent answers now (the CLI's target selection, the job-wide discovery), and the rows ``dynprof
ps`` lists (what the CLI, the sidecar's API and its page show).

An agent that does not answer within the timeout is ``unresponsive`` (its process may hold
the GIL in C code); one that answers with an error, or not in the protocol, is ``error``, with
the error in the row.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynprof import errors, roles
from dynprof.client import AgentClient
from dynprof.output import printable
from dynprof.registry import AgentRecord, list_records, read_record
from dynprof.safetext import one_line

MAX_ASKED_AT_ONCE = 32


def parallel(fn: Any, items: Iterable[Any], max_workers: int = MAX_ASKED_AT_ONCE) -> list[Any]:
    """Run ``fn`` over ``items`` in threads; each result is a value or the exception raised."""
    items = list(items)
    if not items:
        return []

    def wrapped(item: Any) -> Any:
        try:
            return fn(item)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(wrapped, item) for item in items]
        return [f.result() for f in futures]


def _statuses(records: list[AgentRecord], timeout: float) -> list[Any]:
    """Each agent's status, or the exception asking it raised; all asked at once."""
    return parallel(lambda r: AgentClient.for_record(r, timeout=timeout).status(), records)


def refresh_records(records: list[AgentRecord], timeout: float = 1.0) -> list[AgentRecord]:
    """Update rank, world size, job and role from each agent's live status (a launcher such as
    torch.multiprocessing.spawn sets RANK after the process started; a process becomes a
    trainer at its first step); unreachable agents keep what their record says."""
    for record, status in zip(records, _statuses(records, timeout)):
        if isinstance(status, Exception):
            continue
        record.rank = status.rank if status.rank >= 0 else None
        record.world_size = status.world_size if status.world_size >= 0 else None
        record.job_id = status.job_id or None
        record.role = status.role if status.role in roles.ROLES else record.role
    return records


def agent_rows(records: list[AgentRecord], timeout: float) -> list[dict[str, Any]]:
    statuses = _statuses(records, timeout)
    now = time.time()
    for record, status in zip(records, statuses):
        if not isinstance(status, Exception):
            record.rank = status.rank if status.rank >= 0 else None
            record.job_id = status.job_id or None
            record.role = status.role if status.role in roles.ROLES else record.role
    role_of = roles.job_roles(records)
    rows = []
    for record, status in zip(records, statuses):
        row: dict[str, Any] = {
            "pid": record.pid,
            "ppid": record.ppid,
            "rank": record.rank,
            "local_rank": record.local_rank,
            "world_size": record.world_size,
            "job": record.job_id,
            "host": record.host,
            "age_s": round(now - record.started_at, 1),
            "cmdline": record.cmdline,
            "torch": record.torch_version,
            "activation": record.activation,
            "role": role_of[record.pid],
            "phase": None,
            "phase_since": None,
        }
        if isinstance(status, Exception):
            row.update(
                state="unresponsive" if isinstance(status, errors.Timeout) else "error", step=None, error=str(status)
            )
        else:
            row.update(
                rank=status.rank if status.rank >= 0 else None,
                world_size=status.world_size if status.world_size >= 0 else None,
                job=status.job_id or None,
                state=status.trace.state,
                step=status.step,
                step_time_ms=round(status.step_time_s * 1000, 3) if status.step_time_s else None,
                torch_imported=status.torch_imported,
                cuda_initialized=status.cuda_initialized,
                phase=status.phase or None,
                phase_since=status.phase_since or None,
                memory_history=status.memory_history,
                memory_history_detail=status.memory_history_detail or None,
                last_artifact=status.trace.last_artifact or None,
                checkpoint=_checkpoint_state(status.checkpoint_json),
                # what `start --hosts` follows a trace by, node by node
                trace={
                    "group_id": status.trace.group_id or None,
                    "start_step": status.trace.start_step,
                    "steps_done": status.trace.steps_done,
                    "last_artifact_status": status.trace.last_artifact_status or None,
                    "last_error": status.trace.last_error or None,
                },
            )
        rows.append(row)
    return rows


MAX_CHECKPOINT_JSON = 256 * 1024


def _checkpoint_state(text: str) -> dict[str, Any] | None:
    """`dynprof run --checkpoint`'s state as an agent reported it (bounded; None when the job
    did not ask, or the text is not a JSON object of at most :data:`MAX_CHECKPOINT_JSON` bytes)."""
    from dynprof.untrusted import loads_json

    if not text or len(text) > MAX_CHECKPOINT_JSON:
        return None
    try:
        doc = loads_json(text, "the agent's checkpoint state", max_values=20_000)
    except errors.DynprofError:
        return None
    return doc if isinstance(doc, dict) else None


# -- which agents a request targets ---------------------------------------------------------
def select_workers(records: Sequence[AgentRecord]) -> list[AgentRecord]:
    """The training processes among ``records``, job by job (see ``dynprof.roles``): the
    trainers, or where none is known to train yet, the processes that are neither launchers
    (torchrun, accelerate launch, a Python wrapper of the script) nor DataLoader workers."""
    by_job: dict[str | None, list[AgentRecord]] = {}
    for r in records:
        by_job.setdefault(r.job_id, []).append(r)
    kept: list[AgentRecord] = []
    for group in by_job.values():
        kept.extend(roles.targets(group))
    kept.sort(key=lambda r: (r.job_id or "", r.rank if r.rank is not None else -1, r.pid))
    return kept


def resolve(pids: Sequence[int] | None = None, job: str | None = None) -> list[AgentRecord]:
    """The agent records of processes ``pids``, else of job ``job``'s trainers on this node, else
    of every training process here (``--pid`` / ``--job`` / ``--all``), with a precise error
    when none match."""
    if pids:
        records = []
        for pid in pids:
            errors.probe_pid(pid)
            record = read_record(pid)
            if record is None or not record.is_alive():
                raise errors.NoAgent(
                    f"process {pid} has no dynprof agent{_describe_pid(pid)}",
                    help=f"Attach one: `dynprof attach {pid}`, or add --attach to this command; or "
                    + errors.LAUNCH_WITH_AGENT_HELP,
                )
            records.append(record)
        return records
    records = refresh_records(list_records())
    if job:
        matching = [r for r in records if r.job_id == job]
        if not matching:
            # Job ids are what the jobs' environments said: each shown as one printable line.
            jobs = sorted({one_line(r.job_id or "-", 200) for r in records})
            raise errors.DynprofError(
                f"no agent of job {job!r} on this node",
                help=(
                    f"Attach agents to its processes: `dynprof attach --job {one_line(job, 200)}`, or add "
                    "--attach to this command. " + (("Jobs with agents here: " + ", ".join(jobs)) if jobs else "")
                ).strip(),
            )
        chosen = select_workers(matching)
        _note_left_out(job, matching, chosen)
        return chosen
    if not records:
        raise errors.NoAgent("no dynprof agent is running on this node (for this user)")
    return select_workers(records)


_ROLE_NOTES = {
    roles.LAUNCHER: "a launcher",
    roles.WORKER: "a DataLoader worker",
    roles.OTHER: "no optimizer step yet",
    roles.TRAINER: "a trainer",
}


# What _note_left_out has said in this process: a long-lived one (a sidecar hosting a watch,
# which reads the job's stacks and flight recorder at every look) says each once.
_SAID_LEFT_OUT: set[tuple[str, tuple[tuple[int, str], ...]]] = set()
_SAID_LEFT_OUT_LOCK = threading.Lock()
_MAX_SAID_LEFT_OUT = 1024


def _note_left_out(job: str, matching: Sequence[AgentRecord], chosen: Sequence[AgentRecord]) -> None:
    """Say which processes of the job --job does not target, and why (their role): once per
    process for the same processes in the same roles (a watch's every look selects again)."""
    kept = {r.pid for r in chosen}
    left = [r for r in matching if r.pid not in kept]
    if not left:
        return
    role_of = roles.job_roles(matching)
    key = (job, tuple(sorted((r.pid, role_of[r.pid]) for r in left)))
    with _SAID_LEFT_OUT_LOCK:
        if key in _SAID_LEFT_OUT:
            return
        if len(_SAID_LEFT_OUT) >= _MAX_SAID_LEFT_OUT:
            _SAID_LEFT_OUT.clear()
        _SAID_LEFT_OUT.add(key)
    print(
        f"dynprof: job {printable(job)}: not targeting {len(left)} process(es) that are not trainers: "
        + ", ".join(f"pid {r.pid} ({_ROLE_NOTES[role_of[r.pid]]})" for r in left),
        file=sys.stderr,
    )


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        return ""
    return f" ({comm})"
