"""The agents on this node, asked many at once: their records brought up to date from what each
agent answers now (the CLI's target selection, the job-wide discovery), and the rows ``dynprof
ps`` lists (what the CLI, the sidecar's API and its page show).

An agent that does not answer within the timeout is ``unresponsive`` (its process may hold
the GIL in C code); one that answers with an error, or not in the protocol, is ``error``, with
the error in the row.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynprof import errors, roles
from dynprof.client import AgentClient
from dynprof.registry import AgentRecord

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

    # Each call runs in a copy of the caller's context, so a sidecar action's captured output
    # (dynprof.sidecar.actions) follows its worker threads.
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(contextvars.copy_context().run, wrapped, item) for item in items]
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
