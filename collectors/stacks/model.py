"""The stacks of processes, and the one JSON shape they travel in.

A :class:`ProcessStacks` is one process's dump (every thread, innermost frame first), written
as its own file in a stacks artifact (schema ``dynprof.stacks.process``). A :class:`Stacks` is
a merged view of many processes: every process with its main thread, the processes grouped by
main-thread stack (:class:`Group`), and what could not be read (``failures``). Its JSON, the
*stacks document* (schema ``dynprof.stacks``, docs/api.md), is what ``dynprof stacks --json``
prints on one node, over many nodes (``--hosts``) and for ``--merge``, and the ``merged.json``
of a stacks artifact.

:func:`from_json` (a parsed document) and :func:`read_document` (a file) are the only decoders
of stacks documents; :meth:`ProcessStacks.from_json` of process dumps. Their input is untrusted:
fields of the wrong type are dropped, each string, stack and list is cut to a bound (counted in
``truncated``), and a :class:`Budget` bounds what one read may keep in all (values looked at,
distinct frames, characters), so a crafted file costs bounded memory: past the budget the read
is refused with an :class:`~dynprof.errors.ArtifactError`, never a traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from dynprof.errors import ArtifactError

SCHEMA = "dynprof.stacks"  # a stacks document (many processes, grouped)
PROCESS_SCHEMA = "dynprof.stacks.process"  # one process's full dump
SCHEMA_VERSION = 2
KIND = "stacks"
HANG_KIND = "hang"

# -- bounds of what is read back ----------------------------------------------------------------
MAX_PROCESSES = 100_000  # processes in one document, and in one merge
MAX_THREADS = 4096  # threads of one process dump
MAX_FRAMES = 1024  # frames of one stack (innermost kept)
MAX_TEXT = 2000  # characters of one name, path, note or reason
MAX_LOCALS = 100  # locals of one frame
MAX_NOTES = 100  # notes of one process
MAX_FAILURES = 10_000  # failures of one document
MAX_ITEMS = 5_000_000  # values one read looks at (rows, frames, keys)
MAX_DISTINCT_FRAMES = 200_000  # different frames one read keeps (identical frames are shared)
MAX_THREADS_TOTAL = 200_000  # threads one read keeps
MAX_TEXT_TOTAL = 8_000_000  # characters of different strings one read keeps
MAX_FILE_BYTES = 64 << 20  # one document file
MAX_VALUE_CHARS = 1 << 20  # one process row, group or other top-level value of a document file
SMALL_FILE_BYTES = 1 << 20  # a document file up to this size is parsed at once
# How deep a document file may nest, checked in its text before any of it is decoded: a
# document nests 8 levels (document, processes, process, threads, thread, frames, frame,
# locals), a job-wide one's nodes and per-node fields fewer. A file of values nested tens of
# levels deep would otherwise decode at about 1 MB/s (millions of lists) before it is refused.
MAX_DOCUMENT_DEPTH = 16


# -- data -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Frame:
    function: str
    file: str
    line: int = 0
    native: bool = False
    library: str | None = None
    locals: dict[str, str] | None = None

    def key(self) -> tuple[str, str, int]:
        """Identity for grouping: native frames by symbol and library (addresses vary)."""
        if self.native:
            return (self.function, os.path.basename(self.library or self.file), 0)
        return (self.function, self.file, self.line)

    def where(self) -> str:
        if self.native:
            lib = os.path.basename(self.library or self.file or "?")
            return f"{short_symbol(self.function)} [{lib}]"
        return f"{self.function} ({short_path(self.file)}:{self.line})"

    def to_json(self, with_locals: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "function": self.function,
            "file": self.file,
            "line": self.line,
            "native": self.native,
            "library": self.library,
        }
        if with_locals:
            d["locals"] = self.locals
        return d


@dataclass(slots=True)
class ThreadStack:
    tid: int  # the OS thread id (the main thread's equals the pid)
    name: str | None = None
    main: bool = False
    holds_gil: bool | None = None  # None: the reader cannot tell
    active: bool | None = None  # running (not idle/waiting), where the reader can tell
    frames: list[Frame] = field(default_factory=list)  # innermost first

    def to_json(self) -> dict[str, Any]:
        return {
            "tid": self.tid,
            "name": self.name,
            "main": self.main,
            "holds_gil": self.holds_gil,
            "active": self.active,
            "frames": [f.to_json(with_locals=True) for f in self.frames],
        }


@dataclass(slots=True)
class ProcessStacks:
    pid: int
    method: str  # py-spy, pystack, agent, faulthandler, pystack-core
    native: bool = False
    rank: int | None = None
    job: str | None = None
    host: str | None = None  # the node it ran on
    threads: list[ThreadStack] = field(default_factory=list)
    captured_at: float = 0.0
    duration_s: float = 0.0
    fallback_reason: str | None = None  # why an earlier method failed, when one did
    fallback_help: str | None = None
    notes: list[str] = field(default_factory=list)
    file: str | None = None  # in a stacks artifact: the stem of this process's dump files

    def to_json(self) -> dict[str, Any]:
        """This process's full dump (every thread, with locals)."""
        return {
            "schema": PROCESS_SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "pid": self.pid,
            "method": self.method,
            "native": self.native,
            "rank": self.rank,
            "job": self.job,
            "host": self.host,
            "threads": [t.to_json() for t in self.threads],
            "captured_at": self.captured_at,
            "duration_s": self.duration_s,
            "fallback_reason": self.fallback_reason,
            "fallback_help": self.fallback_help,
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: Any, budget: Budget | None = None) -> ProcessStacks:
        """A process dump (untrusted): bounded; :class:`ArtifactError` when it is not one."""
        b = budget if budget is not None else Budget()
        if not isinstance(d, dict):
            raise ArtifactError("not a stack dump (not a JSON object)")
        _check_schema(d.get("schema"), d.get("schema_version"), PROCESS_SCHEMA, "stack dump")
        pid = _int(d.get("pid"))
        if pid is None:
            raise ArtifactError("a stack dump without a pid")
        items = d.get("threads")
        threads = [b.thread(t) for t in b.items(items, MAX_THREADS)] if isinstance(items, list) else []
        notes = d.get("notes")
        return b.process(
            d,
            pid,
            [t for t in threads if t is not None],
            captured_at=_float(d.get("captured_at")),
            duration_s=_float(d.get("duration_s")),
            notes=[n for n in (b.text(x) for x in b.items(notes, MAX_NOTES)) if n] if isinstance(notes, list) else [],
        )

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"

    def main_thread(self) -> ThreadStack | None:
        for t in self.threads:
            if t.main:
                return t
        for t in self.threads:
            if t.tid == self.pid:
                return t
        return self.threads[0] if self.threads else None


@dataclass
class Group:
    """Processes whose main threads have the same stack."""

    members: list[ProcessStacks]
    frames: list[Frame]  # the shared main-thread stack, innermost first
    diverges_at: Frame | None = None  # this group's frame where it departs from group 1
    reference_at: Frame | None = None  # group 1's frame at that depth
    outlier: bool = False
    by_host: bool = False  # name each member's host (processes of several nodes)

    @property
    def labels(self) -> str:
        return rank_labels(self.members, by_host=self.by_host)

    def headline(self) -> str:
        return headline(self.frames)

    def to_json(self) -> dict[str, Any]:
        def who(m: ProcessStacks) -> str:
            return f"{m.label} on {m.host}" if self.by_host and m.host else m.label

        return {
            "ranks": [m.rank for m in self.members],
            "pids": [m.pid for m in self.members],
            "label": self.labels,
            "size": len(self.members),
            "outlier": self.outlier,
            "headline": self.headline(),
            "frames": [f.to_json() for f in self.frames[:MAX_FRAMES]],
            "diverges_at": self.diverges_at.to_json() if self.diverges_at else None,
            "reference_at": self.reference_at.to_json() if self.reference_at else None,
            "members": [{"rank": m.rank, "pid": m.pid, "host": m.host} for m in self.members],
            "odd": [who(m) for m in self.members] if self.outlier else [],
        }


@dataclass
class Stacks:
    """A merged view: processes (each with its main thread at least), their groups (largest
    first; see :func:`collectors.stacks.merge.merge`), what could not be read, and how many
    frames and strings the bounds cut on the way."""

    processes: list[ProcessStacks]
    groups: list[Group] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    truncated: int = 0

    def to_json(self) -> dict[str, Any]:
        """The stacks document (docs/api.md, "The stacks document")."""
        cut = 0
        for p in self.processes:
            main = p.main_thread()
            cut += max(0, len(main.frames) - MAX_FRAMES) if main is not None else 0
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "processes": [process_row(p) for p in self.processes],
            "groups": [g.to_json() for g in self.groups],
            "failures": dict(self.failures),
            "hosts": sorted({p.host for p in self.processes if p.host}),
            "truncated": self.truncated + cut,
        }


def process_row(p: ProcessStacks) -> dict[str, Any]:
    """A process as a stacks document lists it: with its main thread (what a merge groups by)."""
    main = p.main_thread()
    row: dict[str, Any] = {
        "pid": p.pid,
        "rank": p.rank,
        "job": p.job,
        "host": p.host,
        "method": p.method,
        "native": p.native,
        "fallback_reason": p.fallback_reason,
        "fallback_help": p.fallback_help,
        "main_thread": None
        if main is None
        else {
            "tid": main.tid,
            "name": main.name,
            "holds_gil": main.holds_gil,
            "frames": [f.to_json() for f in main.frames[:MAX_FRAMES]],
        },
    }
    if p.file is not None:
        row["file"] = p.file
    return row


# -- decoding --------------------------------------------------------------------------------------
def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and -(1 << 62) < value < 1 << 62 else None


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    number = float(value)
    return number if number == number and abs(number) < 1e18 else 0.0


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _check_schema(schema: Any, version: Any, expected: str, what: str) -> None:
    if schema != expected or version != SCHEMA_VERSION:
        found = f"{str(schema)[:60]!s} version {str(version)[:20]!s}" if schema is not None else "no schema"
        raise ArtifactError(
            f"not a dynprof {what} of this version ({found}; this dynprof reads {expected} version {SCHEMA_VERSION})"
        )


class Budget:
    """What one read may keep in all. Identical frames and strings are kept once (a job's ranks
    mostly share their stacks); values looked at, different frames and characters are counted,
    and past :data:`MAX_ITEMS`, :data:`MAX_DISTINCT_FRAMES` or :data:`MAX_TEXT_TOTAL` the read is
    refused. ``truncated`` counts the frames and strings cut to their bounds."""

    def __init__(self) -> None:
        self.looked_at = 0
        self.chars = 0
        self.truncated = 0
        self.threads_kept = 0
        self.frames_kept = 0
        self._strings: dict[str, str] = {}
        self._frames: dict[tuple[str, str, int, bool, str | None], Frame] = {}

    def count(self, n: int = 1) -> None:
        self.looked_at += n
        if self.looked_at > MAX_ITEMS:
            raise ArtifactError(f"over {MAX_ITEMS} values: refused")

    def items(self, values: list[Any], limit: int) -> list[Any]:
        """The first ``limit`` of ``values``, the rest counted as cut."""
        if len(values) > limit:
            self.truncated += len(values) - limit
            values = values[:limit]
        self.count(len(values))
        return values

    def text(self, value: Any, limit: int = MAX_TEXT) -> str | None:
        if not isinstance(value, str) or not value:
            return None
        if len(value) > limit:
            value = value[:limit]
            self.truncated += 1
        kept = self._strings.get(value)
        if kept is None:
            self.chars += len(value)
            if self.chars > MAX_TEXT_TOTAL:
                raise ArtifactError(f"over {MAX_TEXT_TOTAL} characters of text: refused")
            self._strings[value] = kept = value
        return kept

    def _keep_frame(self) -> None:
        self.frames_kept += 1
        if self.frames_kept > MAX_DISTINCT_FRAMES:
            raise ArtifactError(f"over {MAX_DISTINCT_FRAMES} different frames: refused")

    def frame(self, d: Any, with_locals: bool = True) -> Frame | None:
        if not isinstance(d, dict):
            return None
        function = self.text(d.get("function")) or "?"
        file = self.text(d.get("file")) or ""
        line = _int(d.get("line")) or 0
        native = d.get("native") is True
        library = self.text(d.get("library"))
        found = d.get("locals") if with_locals else None
        if isinstance(found, dict) and found:
            self._keep_frame()  # a frame with locals is its own
            pairs = self.items(list(found.items()), MAX_LOCALS)
            local = {k: self.text(v) or "" for k, v in ((self.text(k), v) for k, v in pairs) if k}
            return Frame(function, file, line, native, library, local or None)
        key = (function, file, line, native, library)
        kept = self._frames.get(key)
        if kept is None:
            self._keep_frame()
            self._frames[key] = kept = Frame(function, file, line, native, library)
        return kept

    def frames(self, items: Any, with_locals: bool = True) -> list[Frame]:
        if not isinstance(items, list):
            return []
        found = (self.frame(d, with_locals) for d in self.items(items, MAX_FRAMES))
        return [f for f in found if f is not None]

    def thread(self, d: Any, with_locals: bool = True) -> ThreadStack | None:
        if not isinstance(d, dict):
            return None
        self.threads_kept += 1
        if self.threads_kept > MAX_THREADS_TOTAL:
            raise ArtifactError(f"over {MAX_THREADS_TOTAL} threads: refused")
        return ThreadStack(
            tid=_int(d.get("tid")) or 0,
            name=self.text(d.get("name")),
            main=d.get("main") is True,
            holds_gil=_bool(d.get("holds_gil")),
            active=_bool(d.get("active")),
            frames=self.frames(d.get("frames"), with_locals),
        )

    def row(self, d: Any) -> ProcessStacks | None:
        """A process row of a stacks document; None for one without a pid."""
        self.count()
        if not isinstance(d, dict) or _int(d.get("pid")) is None:
            return None
        pid = d["pid"]
        main = d.get("main_thread")
        threads = []
        if isinstance(main, dict):
            thread = self.thread({**main, "main": True}, with_locals=False)  # a document's frames have none
            if thread is not None:
                thread.tid = thread.tid or pid
                threads.append(thread)
        return self.process(d, pid, threads, file=self.text(d.get("file"), 255))

    def process(self, d: dict[str, Any], pid: int, threads: list[ThreadStack], **more: Any) -> ProcessStacks:
        """The process of a dump or of a document's row: the fields both carry, read from ``d``,
        and ``more``."""
        return ProcessStacks(
            pid=pid,
            method=self.text(d.get("method"), 40) or "?",
            native=d.get("native") is True,
            rank=_int(d.get("rank")),
            job=self.text(d.get("job")),
            host=self.text(d.get("host")),
            threads=threads,
            fallback_reason=self.text(d.get("fallback_reason")),
            fallback_help=self.text(d.get("fallback_help")),
            **more,
        )

    def failures(self, found: Any) -> dict[str, str]:
        if not isinstance(found, dict):
            return {}
        out: dict[str, str] = {}
        for who, why in self.items(list(found.items()), MAX_FAILURES):
            label = self.text(who, 200)
            if label:
                out[label] = self.text(why) or "?"
        return out


_STREAMED = ("processes", "groups")


def _events_of(doc: Any) -> Iterator[tuple[str, Any, bool]]:
    """A parsed document as the streaming reader gives a file: the elements of its lists of
    processes and groups one by one, every other field whole."""
    if not isinstance(doc, dict):
        raise ArtifactError(f"not a {_DOCUMENT} (not a JSON object)")
    for key, value in doc.items():
        if key in _STREAMED and isinstance(value, list):
            for element in value:
                yield key, element, True
        else:
            yield key, value, False


_DOCUMENT = "dynprof stacks document (the output of `dynprof stacks --json`)"


def _decode(events: Iterable[tuple[str, Any, bool]], budget: Budget) -> Stacks:
    processes: list[ProcessStacks] = []
    failures: dict[str, str] = {}
    schema: Any = None
    version: Any = None
    truncated = 0
    for key, value, streamed in events:
        budget.count()
        if key == "processes":
            if not streamed and not isinstance(value, list):
                raise ArtifactError(f"not a {_DOCUMENT}: no list of processes")
            for row in [value] if streamed else value:
                p = budget.row(row)
                if p is not None:
                    processes.append(p)
            if len(processes) > MAX_PROCESSES:
                raise ArtifactError(f"over {MAX_PROCESSES} processes: refused")
        elif key == "failures":
            failures.update(budget.failures(value))
        elif key == "schema":
            schema = value
        elif key == "schema_version":
            version = value
        elif key == "truncated":
            truncated = max(0, _int(value) or 0)
        # The groups, and anything else, are not read: a merge groups the processes again.
    # Without "processes" (or with an empty list, which a file streams as nothing), no process.
    _check_schema(schema, version, SCHEMA, "stacks document")
    return Stacks(processes=processes, failures=failures, truncated=truncated + budget.truncated)


def from_json(doc: Any, budget: Budget | None = None) -> Stacks:
    """The processes (each with its main thread) and failures of a stacks document, untrusted:
    one node's answer, a job-wide answer, a merge. Its groups are not read (:func:`merge`
    groups again). Raises :class:`ArtifactError` with the reason when it is not one."""
    return _decode(_events_of(doc), budget if budget is not None else Budget())


def read_document(fh: IO[bytes], budget: Budget | None = None) -> Stacks:
    """:func:`from_json` of a document file, read piece by piece: at most
    :data:`MAX_FILE_BYTES`, one row, group or other field at most :data:`MAX_VALUE_CHARS`,
    and never more in memory than the budget allows plus one such value; nesting deeper than
    :data:`MAX_DOCUMENT_DEPTH` is refused from the text, before it is decoded."""
    from dynprof.untrusted import iter_json_document, loads_json, text_depth

    budget = budget if budget is not None else Budget()
    head = fh.read(SMALL_FILE_BYTES + 1)
    try:
        if len(head) <= SMALL_FILE_BYTES:
            if text_depth(head.decode("utf-8", "replace").lstrip(" \t\r\n"))[0] > MAX_DOCUMENT_DEPTH:
                raise ArtifactError(f"JSON nested deeper than {MAX_DOCUMENT_DEPTH} levels: refused")
            return from_json(loads_json(head, "it"), budget)
        # Each row and field is checked for depth from its text before it is decoded.
        events = iter_json_document(_chunks(head, fh), _STREAMED, "it", MAX_VALUE_CHARS, MAX_DOCUMENT_DEPTH)
        return _decode(events, budget)
    except ArtifactError as exc:
        raise ArtifactError(exc.message.removeprefix("it: ")) from None


def _chunks(head: bytes, fh: IO[bytes]) -> Iterator[bytes]:
    total = len(head)
    yield head
    while True:
        chunk = fh.read(1 << 20)
        if not chunk:
            return
        total += len(chunk)
        if total > MAX_FILE_BYTES:
            raise ArtifactError(f"over {MAX_FILE_BYTES >> 20} MiB")
        yield chunk


# -- names ------------------------------------------------------------------------------------------
_LIB_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def short_path(path: str) -> str:
    """``.../site-packages/torch/distributed/x.py`` -> ``torch/distributed/x.py``."""
    for marker in _LIB_MARKERS:
        i = path.rfind(marker)
        if i >= 0:
            return path[i + len(marker) :]
    m = _STDLIB.search(path)
    if m:
        return path[m.end() :]
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return path


def short_symbol(symbol: str, limit: int = 100) -> str:
    """Collapse C++ template arguments and parameter lists of long symbols."""
    if len(symbol) <= limit:
        return symbol
    out: list[str] = []
    depth = 0
    for ch in symbol:
        if ch in "<(":
            if depth == 0:
                out.append(ch + "...")
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
            if depth == 0:
                out.append(ch)
        elif depth == 0:
            out.append(ch)
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SYSTEM_LIBS = ("libc.", "libc-", "libstdc++", "libpthread", "ld-linux", "libgcc", "libpython", "python")


def is_library_path(path: str) -> bool:
    return any(m in path for m in _LIB_MARKERS) or bool(_STDLIB.search(path)) or path.startswith("<frozen")


def headline(frames: Sequence[Frame]) -> str:
    """``in all_reduce (torch/distributed/distributed_c10d.py:2806) <- main (train.py:40)``."""
    py = [f for f in frames if not f.native]
    if not py:
        return f"in {frames[0].where()}" if frames else "no frames"
    text = f"in {py[0].where()}"
    user = next((f for f in py if not is_library_path(f.file)), None)
    if user is not None and user is not py[0]:
        text += f" <- {user.where()}"
    # With native frames: the innermost C/C++ frame of the program's own libraries (a
    # collective's wait, a CUDA synchronize) says what the Python frame is blocked in.
    inner = frames[: frames.index(py[0])]
    waits = [
        f
        for f in inner
        if not os.path.basename(f.library or f.file).startswith(_SYSTEM_LIBS)
        and f.function not in ("???", "")
        and not f.function.startswith("0x")
    ]
    if waits:
        text += f" [native: {short_symbol(waits[0].function, 60)}]"
    return text


MAX_HOSTS_NAMED = 4


def sort_key(p: ProcessStacks) -> tuple[int, int]:
    return (p.rank if p.rank is not None else 1 << 30, p.pid)


def rank_runs(ranks: Sequence[int]) -> str:
    """Sorted ranks in runs: ``[0, 1, 2, 3, 5]`` -> ``0-3,5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def rank_labels(members: Sequence[ProcessStacks], by_host: bool = False) -> str:
    """``ranks 0-6``, ``rank 7``, ``ranks 0,2,5-7``, or pids where ranks are unknown. With
    ``by_host``: ``rank 37 on node-5``, ``ranks 0-7 on node-1, ranks 8-15 on node-2``, or past
    a few hosts ``ranks 0-511 on 64 nodes``."""
    if by_host:
        hosts: dict[str, list[ProcessStacks]] = {}
        for m in members:
            hosts.setdefault(m.host or "?", []).append(m)
        if len(hosts) > MAX_HOSTS_NAMED:
            return f"{rank_labels(members)} on {len(hosts)} nodes"
        order = sorted(hosts.items(), key=lambda kv: min(sort_key(m) for m in kv[1]))
        return ", ".join(f"{rank_labels(ms)} on {host}" for host, ms in order)
    ranks = sorted(m.rank for m in members if m.rank is not None)
    pids = sorted(m.pid for m in members if m.rank is None)
    parts = []
    if ranks:
        parts.append(("ranks " if len(ranks) > 1 else "rank ") + rank_runs(ranks))
    if pids:
        parts.append(("pids " if len(pids) > 1 else "pid ") + ",".join(str(p) for p in pids))
    return " + ".join(parts) or "no processes"
