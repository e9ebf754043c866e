"""The agents of this node, asked many at once: their records brought up to date from what each
agent answers now. Used by the CLI's target selection and by the job-wide discovery."""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynprof import roles
from dynprof.client import AgentClient
from dynprof.registry import AgentRecord


def parallel(fn: Any, items: Iterable[Any], max_workers: int = 32) -> list[Any]:
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


def refresh_records(records: list[AgentRecord], timeout: float = 1.0) -> list[AgentRecord]:
    """Update rank, world size, job and role from each agent's live status (a launcher such as
    torch.multiprocessing.spawn sets RANK after the process started; a process becomes a
    trainer at its first step); unreachable agents keep what their record says."""
    statuses = parallel(lambda r: AgentClient.for_record(r, timeout=timeout).status(), records)
    for record, status in zip(records, statuses):
        if isinstance(status, Exception):
            continue
        record.rank = status.rank if status.rank >= 0 else None
        record.world_size = status.world_size if status.world_size >= 0 else None
        record.job_id = status.job_id or None
        record.role = status.role if status.role in roles.ROLES else record.role
    return records
