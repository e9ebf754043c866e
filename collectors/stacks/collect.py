"""Read the stacks of processes on this node (or of a core file): the stacks kind's one capture
policy, whoever asks for it (``dynprof stacks``, the sidecar's ``stacks`` action, the watch).

    >>> got = collect(StacksRequest(job="j1"))            # doctest: +SKIP
    >>> got.stacks.groups[0].size, got.artifact            # doctest: +SKIP

Each process is read from outside first: py-spy, then pystack (pystack first with native
frames). When reading from outside is refused (no CAP_SYS_PTRACE, Yama ptrace_scope, another
user), the dynprof agent inside the process answers instead, and the answer says so and why.
All targets are read in parallel; one artifact holds every process's dump and the merged view.

Not imported by ``collectors.stacks`` itself: the agent, which imports that package, never
loads this policy (nor the floor modules it needs: agents, registry, the store).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from collectors.stacks import readers
from collectors.stacks.artifact import write_request_artifact
from collectors.stacks.merge import Source, merge
from collectors.stacks.model import KIND, Budget, ProcessStacks, Stacks, from_json
from dynprof import errors
from dynprof.agents import parallel, resolve
from dynprof.client import AgentClient
from dynprof.paths import run_dir
from dynprof.proto import pb
from dynprof.registry import AgentRecord, read_record
from dynprof.requests import TARGETS, TargetedRequest, check_timeout, read_options
from dynprof.store import ArtifactStore

METHODS = ("auto", "py-spy", "pystack", "agent")
DEFAULT_TIMEOUT_S = 15.0
CORE_TIMEOUT_S = 120.0  # a core file is read once, with every library: at least this long
AGENT_TIMEOUT_S = 10.0  # the agent answers from inside the process: never longer than this


@dataclass(frozen=True)
class StacksRequest(TargetedRequest):
    """What to read: exactly one of ``pids``, ``job`` (its trainers on this node), ``all``
    (every agent here) or ``core`` (a core file, with its ``executable`` if given); how
    (``method``, ``native`` frames, ``locals``, ``timeout`` per process and reader); and
    whether the answer is kept as an artifact (``save``). Checked when made: a bad request
    raises :class:`~dynprof.errors.UsageError`, never a failure further down."""

    core: str | None = None
    executable: str | None = None
    native: bool = False
    locals: bool = False
    method: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S
    save: bool = True

    def __post_init__(self) -> None:
        chosen = [x for x in (self.pids, self.job, self.all, self.core) if x]
        if len(chosen) != 1:
            raise errors.UsageError(
                "give exactly one of --pid, --job, --all or --core", help="See `dynprof stacks --help`."
            )
        if self.executable and not self.core:
            raise errors.UsageError("--executable goes with --core")
        if self.method not in METHODS:
            raise errors.UsageError(f"unknown method {self.method[:40]!a}: one of {', '.join(METHODS)}")
        check_timeout(self.timeout)
        self.check_pids()

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "native": "bool",
        "locals": "bool",
        "method": "str",
        "timeout": "float",
        "no_save": "bool",
    }

    @classmethod
    def from_json(cls, doc: Any) -> StacksRequest:
        """The request of a JSON object of the ``stacks`` action's options (:meth:`to_json`).
        A core file is never named in JSON: it is a file of the machine that reads it."""
        o = read_options(doc, cls.OPTIONS, "stacks")
        return cls(
            **cls.targets_of(o),
            native=o.get("native", False),
            locals=o.get("locals", False),
            method=o.get("method", "auto"),
            timeout=o.get("timeout", DEFAULT_TIMEOUT_S),
            save=not o.get("no_save", False),
        )

    def to_json(self) -> dict[str, Any]:
        """The request as the ``stacks`` action's options (a core file's request has none)."""
        if self.core:
            raise errors.UsageError("a core file is read on its own machine: its request is not sent as JSON")
        out: dict[str, Any] = {"timeout": self.timeout, **self.targets_json()}
        for key in ("native", "locals"):
            if getattr(self, key):
                out[key] = True
        if self.method != "auto":
            out["method"] = self.method
        if not self.save:
            out["no_save"] = True
        return out

    def options(self, pids: list[int]) -> dict[str, Any]:
        """The request as the artifact's manifest records it (``pids``: the processes read)."""
        return {"native": self.native, "locals": self.locals, "method": self.method, "targets": pids, "core": self.core}


@dataclass
class Collected:
    """The merged stacks of every process read (``stacks.failures``: who was not read, and why),
    how long reading took, and the artifact's path (``None`` without ``save``)."""

    stacks: Stacks
    elapsed_s: float
    artifact: str | None = None

    @property
    def exit_code(self) -> int:
        """1 when some process was not read, else 0."""
        return 1 if self.stacks.failures else 0

    @property
    def messages(self) -> list[str]:
        """Nothing is said on stderr: who was not read is in the document."""
        return []

    def to_json(self) -> dict[str, Any]:
        """The stacks document of one node's answer (``dynprof stacks --json``, the sidecar's
        ``stacks`` action): the stacks, the artifact and the seconds reading took."""
        return {**self.stacks.to_json(), "artifact": self.artifact, "elapsed_s": round(self.elapsed_s, 3)}

    @classmethod
    def from_json(cls, doc: Any, budget: Budget | None = None) -> Collected:
        """A node's answer, untrusted (:func:`collectors.stacks.from_json` reads its stacks
        within ``budget``); a value of the wrong type is left out."""
        stacks = from_json(doc, budget)
        elapsed = doc.get("elapsed_s") if isinstance(doc, dict) else None
        artifact = doc.get("artifact") if isinstance(doc, dict) else None
        return cls(
            stacks,
            float(elapsed) if isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool) else 0.0,
            artifact if isinstance(artifact, str) else None,
        )


@dataclass
class Target:
    pid: int
    record: AgentRecord | None

    @property
    def rank(self) -> int | None:
        return self.record.rank if self.record is not None else None

    @property
    def label(self) -> str:
        return f"pid {self.pid}" if self.rank is None else f"rank {self.rank} (pid {self.pid})"


def collect(request: StacksRequest) -> Collected:
    """Read what ``request`` names, merge it, and (with ``save``) keep it as a stacks artifact.

    Raises the first target's error when no process could be read; otherwise each process not
    read is a failure of the answer, the others are read."""
    t0 = time.monotonic()
    failures: dict[str, str] = {}
    if request.core:
        processes = [_core(request)]
    else:
        targets = _targets(request)
        results = parallel(lambda t: _capture(t, request), targets)
        processes = [r for r in results if isinstance(r, ProcessStacks)]
        failed = [(t, r) for t, r in zip(targets, results) if not isinstance(r, ProcessStacks)]
        for t, exc in failed:
            if not isinstance(exc, errors.DynprofError):
                raise exc
            failures[t.label] = exc.message
        if not processes:
            raise failed[0][1]  # nothing read: the first target's error says what to do
    elapsed = time.monotonic() - t0
    stacks = merge([Source(Stacks(processes, failures=failures))])
    artifact = _save(request, processes, failures) if request.save else None
    return Collected(stacks, elapsed, artifact)


# -- targets ---------------------------------------------------------------------------------
def _targets(request: StacksRequest) -> list[Target]:
    if request.pids:
        targets = []
        for pid in dict.fromkeys(request.pids):
            errors.probe_pid(pid)  # dead pid or zombie (3), another user's (4)
            record = read_record(pid)
            if record is not None and (record.pid != pid or not record.is_alive()):
                record = None
            targets.append(Target(pid, record))
        return targets
    return [Target(r.pid, r) for r in resolve(job=request.job)]


# -- one process -------------------------------------------------------------------------------
def _capture(target: Target, request: StacksRequest) -> ProcessStacks:
    pid = target.pid
    attempts: list[str] = []
    refusal: str | None = None
    if request.method != "agent":
        refusal = readers.ptrace_refusal(pid)
        if refusal is None:
            capture = {"py-spy": readers.capture_py_spy, "pystack": readers.capture_pystack}
            if request.method != "auto":
                order = [request.method]
            else:
                order = ["pystack", "py-spy"] if request.native else ["py-spy", "pystack"]
            for name in order:
                try:
                    result = capture[name](pid, native=request.native, locals=request.locals, timeout=request.timeout)
                except readers.CaptureError as exc:
                    attempts.append(f"{exc.method} failed: {exc.reason}")
                    continue
                return _finish(result, target, attempts)
        else:
            attempts.append(refusal)
    if target.record is not None and request.method in ("auto", "agent"):
        try:
            result = _from_agent(target, request)
        except errors.DynprofError as exc:
            gone = errors.process_gone(pid)
            if gone is not None:
                raise errors.ProcessNotFound(f"process {pid} {gone} while its stacks were being read") from None
            if request.method == "agent":
                raise  # the agent's own error (no agent, timed out...) says it best
            attempts.append(f"the agent could not answer: {exc.message}")
        else:
            if request.native:
                result.notes.append("native frames are not available from inside the process")
            result = _finish(result, target, attempts)
            if refusal is not None:
                result.fallback_help = errors.PermissionDenied.default_help
            return result
    raise _classify(pid, refusal, attempts, target.record is not None, request)


def _finish(result: ProcessStacks, target: Target, attempts: list[str]) -> ProcessStacks:
    rec = target.record
    if rec is not None:
        result.rank, result.job, result.host = rec.rank, rec.job_id, rec.host
    else:
        result.host = socket.gethostname()
    if attempts:
        result.fallback_reason = "; ".join(attempts)
    return result


def _from_agent(target: Target, request: StacksRequest) -> ProcessStacks:
    assert target.record is not None
    client = AgentClient.for_record(target.record, timeout=min(request.timeout, AGENT_TIMEOUT_S))
    # In the run directory: the agent writes only into dynprof's own places.
    with tempfile.TemporaryDirectory(prefix="stacks-", dir=run_dir()) as tmp:
        out = os.path.join(tmp, f"{target.pid}.json")
        client.request(dump_stacks=pb.DumpStacksRequest(all_threads=True, locals=request.locals, output_path=out))
        try:
            with open(out) as fh:
                return ProcessStacks.from_json(json.load(fh))
        except (OSError, ValueError, RecursionError, errors.ArtifactError) as exc:
            raise errors.AgentError(
                f"the agent of process {target.pid} left an unreadable stack dump: {type(exc).__name__}",
                help=f"See the agent's log ({target.record.log or 'dynprof ps'}); "
                "`--method py-spy` reads the stacks from outside.",
            ) from None


def _classify(
    pid: int, refusal: str | None, attempts: list[str], has_agent: bool, request: StacksRequest
) -> errors.DynprofError:
    detail = "; ".join(attempts)
    gone = errors.process_gone(pid)
    if gone is not None:
        # The readers' own messages ("Failed to get process executable name") say nothing useful.
        return errors.ProcessNotFound(f"process {pid} {gone} while its stacks were being read")
    if refusal is not None:
        hint = (
            ""
            if has_agent
            else (
                " With the dynprof agent in the process, dynprof would ask it instead (attaching one "
                "needs ptrace too): " + errors.LAUNCH_WITH_AGENT_HELP
            )
        )
        return errors.PtraceRefused(
            f"cannot read the stacks of pid {pid}: {detail}", help=errors.PermissionDenied.default_help + hint
        )
    if request.method == "agent" and not has_agent:
        return errors.NoAgent(f"process {pid} has no dynprof agent to ask (--method agent)")
    if readers.looks_like_python(pid) is False:
        return errors.NotPython(f"process {pid} ({_comm(pid)}) is not a Python process: {detail}")
    return errors.DynprofError(
        f"cannot read the stacks of pid {pid}: {detail}",
        help="Try --method pystack or --method py-spy, or a longer --timeout; "
        "check that py-spy and pystack are installed (`pip install py-spy pystack`).",
    )


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


# -- core files ------------------------------------------------------------------------------
def _core(request: StacksRequest) -> ProcessStacks:
    assert request.core is not None
    for what, path in (("core file", request.core), ("executable", request.executable)):
        if not path:
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise errors.DynprofError(f"no {what} {path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            # pystack would block on a FIFO, or read a device for ever.
            raise errors.DynprofError(f"{what} {path} is not a regular file")
    try:
        return readers.capture_core(
            request.core,
            request.executable,
            native=request.native,
            locals=request.locals,
            timeout=max(request.timeout, CORE_TIMEOUT_S),
        )
    except readers.CaptureError as exc:
        raise errors.DynprofError(
            f"cannot read core file {request.core}: {exc.reason}",
            help="Give the Python executable that produced it with --executable; the core must come from "
            "a Python process and the shared libraries it used must be present here.",
        ) from None


# -- artifact --------------------------------------------------------------------------------
def _save(request: StacksRequest, processes: list[ProcessStacks], failures: dict[str, str]) -> str:
    jobs = {p.job for p in processes if p.job}
    job = request.job or (jobs.pop() if len(jobs) == 1 else None)
    writer = ArtifactStore().create(KIND, job=job, options=request.options([p.pid for p in processes]))
    summary = write_request_artifact(writer, processes, failures)
    return str(writer.finish("partial" if failures else "complete", summary=summary).path)
