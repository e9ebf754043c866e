"""A fake agent record, for tests of what reads the registry without starting an agent.

``agent_record(pid, **fields)`` is an :class:`dynprof.registry.AgentRecord` of a plain Python
process that has no rank, no job and no live socket; each test names only what it is about
(its rank, job, role, socket...). ``local_rank`` follows ``rank`` unless given.
``record_doc(pid, **fields)`` is the same record as the JSON document a test writes itself.
"""

from __future__ import annotations

from typing import Any

from dynprof.registry import AgentRecord

_DEFAULTS: dict[str, Any] = {
    "ppid": 1,
    "host": "h",
    "rank": None,
    "world_size": None,
    "job_id": None,
    "python_version": "3",
    "torch_version": None,
    "dynprof_version": "0",
    "started_at": 0.0,
    "start_ticks": None,
    "socket": "/x",
    "log": "",
    "activation": "run",
}


def record_doc(pid: int, **fields: Any) -> dict[str, Any]:
    """The registration record of process ``pid`` as JSON holds it: the defaults above, then
    ``fields``. Only the fields every record has (no role, schema_version or extra, unless
    given): a record written by hand, as a test forges one."""
    doc = {"pid": pid, **_DEFAULTS, "cmdline": ["python"], **fields}
    doc.setdefault("local_rank", doc["rank"])
    return doc


def agent_record(pid: int, **fields: Any) -> AgentRecord:
    """The record of process ``pid``: the defaults above, then ``fields``."""
    return AgentRecord(**record_doc(pid, **fields))
