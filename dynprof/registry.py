"""Registration records of the agents on this node.

Each agent writes ``<run dir>/agents/<pid>.json`` next to its socket ``<pid>.sock``. The CLI
discovers agents by reading these records; records whose process is gone (or whose pid was
reused by another process) are removed when read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynprof import jsontext
from dynprof.paths import agents_dir
from dynprof.roles import ROLES, makes_launcher
from dynprof.safetext import valid_text

RECORD_SCHEMA_VERSION = 1
# The per-process logs (run directory's logs/PID.log) of processes that are gone: kept 7 days,
# and at most 500 of them (the oldest go first), so a long-lived node's run directory does not
# grow without bound. A log whose process has a record (a live agent, or one in another pid
# namespace) or still runs here is never removed. Pruned by the commands and the sidecar that
# list the agents (list_records), at most every 5 minutes per process.
LOG_KEEP_S = 7 * 86400.0
MAX_DEAD_LOGS = 500
PRUNE_EVERY_S = 300.0
_LOG_NAME = re.compile(r"([0-9]{1,10})\.log")
_last_prune: dict[Path, float] = {}


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[bytes | None, int | None]:
    """``pid``'s state letter (field 3 of /proc/PID/stat: R, S, Z...) and start time in clock
    ticks since boot (field 22); None for what cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None, None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    state = rest[0] if rest else None
    try:
        return state, int(rest[19])
    except (IndexError, ValueError):
        return state, None


@dataclass
class AgentRecord:
    pid: int
    ppid: int
    host: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    job_id: str | None
    cmdline: list[str]
    python_version: str
    torch_version: str | None
    dynprof_version: str
    started_at: float
    start_ticks: int | None
    socket: str
    log: str
    activation: str
    # what the process is in its job (see dynprof.roles); None from an agent that did not say
    role: str | None = None
    schema_version: int = RECORD_SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> AgentRecord:
        """A record from its JSON, checked: a ValueError or TypeError for anything ill-formed (a
        record is read back from a file, so it is checked like any other input)."""
        if not isinstance(data, dict):
            raise TypeError(f"a record is a JSON object, not {type(data).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        record = cls(**{k: v for k, v in data.items() if k in known})
        record._check()
        record._make_valid_text()
        return record

    def _make_valid_text(self) -> None:
        """A record's text as valid text: a job id or command line holding bytes that are not
        UTF-8 (a JSON ``\\udcff``, from an agent that wrote them raw) is read with them
        escaped (``\\xff``), so that no reader (a page, ``/metrics``, the wire) fails on it."""
        for name in ("host", "job_id", "python_version", "torch_version", "dynprof_version"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, valid_text(value))
        self.cmdline = [valid_text(a) for a in self.cmdline]

    def _check(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (is_int(self.pid) and 0 < self.pid <= 2**22) or not is_int(self.ppid):
            raise ValueError("bad pid")
        for name in ("rank", "local_rank", "world_size", "start_ticks"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                raise ValueError(f"bad {name}")
        for name in ("host", "python_version", "dynprof_version", "socket", "log", "activation"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"bad {name}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError("bad role")
        for name in ("job_id", "torch_version"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"bad {name}")
        if not isinstance(self.cmdline, list) or not all(isinstance(a, str) for a in self.cmdline):
            raise ValueError("bad cmdline")
        if not isinstance(self.started_at, (int, float)) or isinstance(self.started_at, bool):
            raise ValueError("bad started_at")
        if not isinstance(self.extra, dict):
            raise ValueError("bad extra")

    def is_alive(self) -> bool:
        """The record's process runs: it exists, is the same process (its start time), and
        has not exited (a zombie, which its parent has not reaped yet, has: no agent is left
        in it, and its record and socket may go)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        state, ticks = _stat(self.pid)
        if state in (b"Z", b"X"):
            return False
        return ticks is None or self.start_ticks is None or ticks == self.start_ticks


def record_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or agents_dir()) / f"{pid}.json"


def socket_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or agents_dir()) / f"{pid}.sock"


def write_record(record: AgentRecord, directory: Path | None = None) -> Path:
    path = record_path(record.pid, directory)
    tmp = path.with_suffix(".json.tmp")
    try:
        tmp.write_text(jsontext.dumps(record.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full run directory keeps no half-written record behind
        raise
    return path


def remove_record(pid: int, directory: Path | None = None) -> None:
    for p in (record_path(pid, directory), socket_path(pid, directory)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def read_record(pid: int, directory: Path | None = None) -> AgentRecord | None:
    try:
        data = json.loads(record_path(pid, directory).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    try:
        return AgentRecord.from_dict(data)
    except (TypeError, ValueError):
        return None


def _socket_answers(path: Path, timeout: float = 0.2) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def list_records(directory: Path | None = None, clean: bool = True) -> list[AgentRecord]:
    """Records of live agents, newest first; records of dead processes are removed."""
    directory = directory or agents_dir()
    records = []
    for path in directory.glob("*.json"):
        try:
            record = AgentRecord.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, RecursionError):
            continue
        if not record.is_alive():
            # A record is removed only when nothing listens on its socket: an agent in another
            # pid namespace (a pod seen from a node's sidecar) has a pid that means nothing
            # here, yet it lives, and its record is not ours to delete.
            if clean and not _socket_answers(socket_path(record.pid, directory)):
                remove_record(record.pid, directory)
            continue
        records.append(record)
    records.sort(key=lambda r: r.started_at, reverse=True)
    if clean:
        logs = directory.parent / "logs"
        now = time.monotonic()
        if now - _last_prune.get(logs, -PRUNE_EVERY_S) >= PRUNE_EVERY_S:
            _last_prune[logs] = now
            with contextlib.suppress(OSError):
                prune_logs(logs, directory)
    return records


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace runs (as any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it runs, as another user
    return True


def prune_logs(logs: Path, agents: Path, now: float | None = None) -> list[Path]:
    """Remove the logs of processes that are gone (no record in ``agents``, not running here)
    older than :data:`LOG_KEEP_S`, then the oldest of them past :data:`MAX_DEAD_LOGS`; the
    paths removed. Only plain files named ``PID.log`` are looked at, never through a link."""
    now = time.time() if now is None else now
    dead: list[tuple[float, Path]] = []
    with os.scandir(logs) as entries:
        for entry in entries:
            found = _LOG_NAME.fullmatch(entry.name)
            if found is None or not entry.is_file(follow_symlinks=False):
                continue
            pid = int(found.group(1))
            if record_path(pid, agents).exists() or pid_alive(pid):
                continue
            with contextlib.suppress(OSError):
                dead.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
    dead.sort()
    old = [p for mtime, p in dead if now - mtime > LOG_KEEP_S]
    over = [p for _, p in dead[: max(0, len(dead) - MAX_DEAD_LOGS)]]
    removed = []
    for path in dict.fromkeys(old + over):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def has_agent_children(pid: int, job_id: str | None, rank: int | None = None) -> bool:
    """A live agent of the same job is a child of ``pid`` that makes it a launcher (see
    :func:`dynprof.roles.makes_launcher`)."""
    return any(r.ppid == pid and r.job_id == job_id and makes_launcher(r, rank) for r in list_records(clean=False))
