"""Dump the NCCL flight recorder of this node's ranks and analyse them together: the nccl kind's
one capture policy, whoever asks (``dynprof nccl``, the sidecar's ``nccl`` action, the watch).

    >>> got = collect(NcclRequest(job="j1"))                 # doctest: +SKIP
    >>> got.analysis["process_groups"][0]["verdict"], got.artifact   # doctest: +SKIP

Each rank's agent asks torch for its dump; a rank whose agent cannot answer (its main thread
holds the GIL, or it has no agent) is asked through torch's own dump pipe, which needs no
Python. One artifact holds every rank's dump and the analysis. A rank's dump is read up to
:data:`MAX_DUMP_BYTES`; a larger one is that rank's failure, named with its size.

Not imported by ``collectors.flight_recorder`` itself: the agent, which imports that package,
never loads this policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from collectors import flight_recorder as fr
from dynprof import errors, untrusted
from dynprof.agents import parallel, resolve
from dynprof.client import AgentClient
from dynprof.proto import pb
from dynprof.registry import AgentRecord, read_record
from dynprof.requests import TARGETS, TargetedRequest, check_timeout, read_options
from dynprof.units import human_bytes

MAX_DUMP_BYTES = 64 * 1024 * 1024
"""The largest rank's dump read (on this node or back from a node): its parsed form takes a few
times its size in memory."""
DEFAULT_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class NcclRequest(TargetedRequest):
    """Whose recorders: exactly one of ``pids``, ``job`` (its trainers on this node) or ``all``;
    what: only the collectives not yet completed (``only_active``), with or without the Python
    stacks of each collective's caller (``stack_traces``); ``timeout`` per rank. Checked when
    made: a bad request raises :class:`~dynprof.errors.UsageError`."""

    only_active: bool = False
    stack_traces: bool = True
    timeout: float = DEFAULT_TIMEOUT_S
    # with ``job`` or ``all``: processes not asked (the watch's ranks whose agents did not answer
    # its look: asked, each would hold the read for ``timeout``)
    skip: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.check_one_target("nccl")
        check_timeout(self.timeout)
        self.check_pids()
        if self.skip:
            if self.pids:
                raise errors.UsageError("skip goes with a job or all, not with process ids (give the ids to ask)")
            self.check_pids(self.skip, "a process id to skip")

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "only_active": "bool",
        "no_stack_traces": "bool",
        "timeout": "float",
        "skip_pid": "ints",
    }

    @classmethod
    def from_json(cls, doc: Any) -> NcclRequest:
        """The request of a JSON object of the ``nccl`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "nccl")
        return cls(
            **cls.targets_of(o),
            only_active=o.get("only_active", False),
            stack_traces=not o.get("no_stack_traces", False),
            timeout=o.get("timeout", DEFAULT_TIMEOUT_S),
            skip=tuple(o.get("skip_pid", ())),
        )

    def to_json(self) -> dict[str, Any]:
        """The request as the ``nccl`` action's options (:meth:`options`)."""
        return self.options()

    def options(self) -> dict[str, Any]:
        """The request as the sidecar's ``nccl`` action takes it (the options it leaves unset out)."""
        out: dict[str, Any] = {"timeout": self.timeout, **self.targets_json()}
        if self.only_active:
            out["only_active"] = True
        if not self.stack_traces:
            out["no_stack_traces"] = True
        if self.skip:
            out["skip_pid"] = list(self.skip)
        return out


MAX_NOTE_CHARS = 2000  # a note read back from a node's answer


@dataclass
class Collected:
    """The analysis of every rank dumped (``analysis``), the artifact holding the dumps, what
    is worth saying besides (``notes``: a rank dumped through the pipe, a rank not dumped),
    and whether some rank could not be dumped (``partial``)."""

    analysis: dict[str, Any] | None
    artifact: str | None
    artifact_id: str | None
    elapsed_s: float
    ranks: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partial: bool = False

    @property
    def exit_code(self) -> int:
        """1 when some rank could not be dumped, else 0."""
        return 1 if self.partial else 0

    @property
    def messages(self) -> list[str]:
        """Nothing is said on stderr: the notes are in the document."""
        return []

    def to_json(self) -> dict[str, Any]:
        """One node's answer (``dynprof nccl --json``, the sidecar's ``nccl`` action): the
        analysis, the artifact (its path, and its id under the store: ``nccl --hosts`` reads
        every rank's dump from it through each node's sidecar) and the notes."""
        return {
            "artifact": self.artifact,
            "artifact_id": self.artifact_id,
            "elapsed_s": round(self.elapsed_s, 3),
            "analysis": self.analysis,
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Collected:
        """A node's answer, untrusted: each field taken only when it has its type (the analysis
        an object, the artifact's path and id strings, the seconds a number), each note a line
        of at most :data:`MAX_NOTE_CHARS`; what is missing or of another type is left empty.
        The ranks and whether the dump was partial are the node's own (its exit code)."""
        doc = doc if isinstance(doc, dict) else {}
        analysis, artifact, artifact_id = doc.get("analysis"), doc.get("artifact"), doc.get("artifact_id")
        elapsed = doc.get("elapsed_s")
        notes = doc.get("notes")
        return cls(
            analysis if isinstance(analysis, dict) else None,
            artifact if isinstance(artifact, str) else None,
            artifact_id if isinstance(artifact_id, str) else None,
            float(elapsed) if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) else 0.0,
            notes=[str(n)[:MAX_NOTE_CHARS] for n in notes] if isinstance(notes, list) else [],
        )


def collect(request: NcclRequest) -> Collected:
    """Dump the recorders ``request`` names into one artifact and analyse them.

    Raises :class:`~dynprof.errors.Unsupported` when no rank records (the job runs without the
    recorder; nothing is kept), or the first rank's error when no rank could be dumped."""
    from dynprof.store import ArtifactStore

    targets = _targets(request)
    jobs = {r.job_id for _, r in targets if r is not None and r.job_id}
    job = request.job or (jobs.pop() if len(jobs) == 1 else None)
    t0 = time.monotonic()
    writer = ArtifactStore().create(
        fr.KIND,
        job=job,
        options={
            "targets": [pid for pid, _ in targets],
            "only_active": request.only_active,
            "stack_traces": request.stack_traces,
        },
    )
    try:
        results = parallel(lambda t: _dump(t[0], t[1], writer, request), targets)
        per_rank: dict[int, dict[str, Any]] = {}
        notes: list[str] = []
        problems: list[tuple[int, errors.DynprofError]] = []
        for (pid, _record), res in zip(targets, results):
            if isinstance(res, errors.DynprofError):
                problems.append((pid, res))
                continue
            if isinstance(res, Exception):
                raise res
            rank, doc, note = res
            per_rank[rank] = doc
            if note:
                notes.append(note)
        if not per_rank:
            not_enabled: list[errors.DynprofError] = [e for _, e in problems if isinstance(e, errors.Unsupported)]
            first = (not_enabled or [e for _, e in problems])[0]
            if len(not_enabled) == len(problems):
                writer.abort("the flight recorder is off")  # no rank records: nothing to keep
            else:
                writer.finish("failed", error=first.message)
            raise first
        analysis = fr.analyze(per_rank)
        for pid, exc in problems:
            notes.append(f"pid {pid}: no dump: {exc.message}")
        writer.write_json("analysis.json", analysis)
        writer.write_text("analysis.txt", fr.render_analysis(analysis) + "".join(f"note: {n}\n" for n in notes))
        summary = {
            "ranks": sorted(per_rank),
            "notes": notes,
            "verdicts": [pg["verdict"] for pg in analysis["process_groups"]],
            "hung": [pg["process_group"] for pg in analysis["process_groups"] if pg["hung"]],
        }
        art = writer.finish("partial" if problems else "complete", summary=summary)
    except BaseException as exc:
        if writer.finished is None and writer.aborted is None:
            writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    return Collected(
        analysis=analysis,
        artifact=str(art.path),
        artifact_id=art.id,
        elapsed_s=time.monotonic() - t0,
        ranks=sorted(per_rank),
        notes=notes,
        partial=bool(problems),
    )


def _targets(request: NcclRequest) -> list[tuple[int, AgentRecord | None]]:
    if request.pids:
        out: list[tuple[int, AgentRecord | None]] = []
        for pid in dict.fromkeys(request.pids):
            errors.probe_pid(pid)
            record = read_record(pid)
            out.append((pid, record if record is not None and record.is_alive() else None))
        return out
    records = [(r.pid, r) for r in resolve(job=request.job)]
    kept: list[tuple[int, AgentRecord | None]] = [(pid, r) for pid, r in records if pid not in request.skip]
    if records and not kept:
        raise errors.DynprofError(
            f"every process of {'job ' + repr(request.job) if request.job else 'this node'} here was to be skipped "
            f"({', '.join(map(str, sorted(request.skip)))}): no recorder was asked"
        )
    return kept


def _dump(pid: int, record: AgentRecord | None, writer: Any, request: NcclRequest) -> Any:
    rank = record.rank if record is not None else None
    if rank is None:
        rank = _environ_rank(pid)
    stem = f"rank{rank}-pid{pid}" if rank is not None else f"pid{pid}"
    reason = "no dynprof agent"
    if record is not None:
        path = writer.file_path(f"{stem}.json")
        try:
            AgentClient.for_record(record, timeout=request.timeout).request(
                flight_recorder_dump=pb.FlightRecorderDumpRequest(
                    output_path=str(path),
                    include_stack_traces=request.stack_traces,
                    only_active=request.only_active,
                )
            )
        except errors.Unsupported:
            raise
        except errors.DynprofError as exc:
            reason = exc.message
        else:
            return (rank if rank is not None else pid, _read_dump(path.parent, path.name, pid), None)
    if rank is None:
        raise errors.DynprofError(f"pid {pid}: cannot tell its rank ({reason}), so cannot find its dump pipe")
    try:
        raw, where = fr.dump_through_pipe(pid, rank, timeout=request.timeout)
    except fr.NotEnabled as exc:
        raise errors.Unsupported(str(exc), help=errors.FLIGHT_RECORDER_HELP) from None
    except fr.DumpError as exc:
        raise errors.DynprofError(f"pid {pid}: {reason}; and through torch's pipe: {exc}") from None
    writer.write_bytes(f"{stem}.raw", raw)
    doc = {
        "schema": fr.SCHEMA,
        "schema_version": fr.SCHEMA_VERSION,
        "method": "pipe",
        "pid": pid,
        "rank": rank,
        "dumps": {"nccl": fr.load_dump_bytes(raw)},
        "source": where,
    }
    writer.write_json(f"{stem}.json", doc)
    return (rank, doc, f"rank {rank}: dumped through torch's pipe ({reason})")


def _environ_rank(pid: int) -> int | None:
    try:
        value = fr.process_environ(pid).get("RANK")
    except OSError:
        return None
    return int(value) if value and value.isdigit() else None


def _read_dump(directory: Any, name: str, pid: int) -> Any:
    """A rank's dump as its agent wrote it, refused over MAX_DUMP_BYTES (that rank's failure)."""
    try:
        data = untrusted.read_bytes_in(directory, name, MAX_DUMP_BYTES)
        return untrusted.loads_json(data, f"the dump of pid {pid}")
    except errors.ArtifactError as exc:
        raise errors.DynprofError(
            f"pid {pid}: its dump cannot be read: {exc.message}",
            help=f"A dump is read up to {human_bytes(MAX_DUMP_BYTES)}: leave out the stacks (--no-stack-traces) "
            "or the completed collectives (--only-active), or record fewer (`dynprof run --flight-recorder N`).",
        ) from None
