"""Start the dynprof agent inside a running Python process that was launched without it.

Methods, best first (``method="auto"``):

* ``remote-exec``: Python 3.14+ targets, when dynprof runs under the same Python version:
  ``sys.remote_exec(pid, script)``.
* ``gdb``: gdb queues ``Py_AddPendingCall(PyRun_SimpleString, page)`` (see
  :mod:`dynprof.attach._gdb`); CPython runs it on the main thread at its next eval-breaker
  check, the same safe point as ``sys.remote_exec``. If the main thread stays parked in C
  (``time.sleep``, a blocking read) and no thread holds the GIL, the payload runs on the main
  thread under ``PyGILState_Ensure/Release``. If a thread holds the GIL in native code, attach
  refuses with that thread's stack: nothing can run until it returns (the queued request then
  runs by itself).

Never used, because both corrupted or hung a training loop when measured: running Python
inside whatever C code gdb interrupted (pyrasite), and ``dlopen`` from a hijacked thread.

Transport (how the payload gets in) is this package; the payload only starts the ordinary
agent (:func:`dynprof.agent.start`) with ``activation="attach"``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import dynprof
from dynprof import errors
from dynprof.attach import _bootstrap, _preflight, _remote
from dynprof.attach._discover import JobProcess as JobProcess
from dynprof.attach._discover import JobSearch as JobSearch
from dynprof.attach._discover import find_job_processes as find_job_processes
from dynprof.attach._gdb import GdbSession
from dynprof.client import AgentClient
from dynprof.paths import artifact_dir, ensure_private_dir, run_dir
from dynprof.registry import AgentRecord, read_record

METHODS = ("auto", "remote-exec", "gdb")
DYNPROF_HOME = str(Path(dynprof.__file__).resolve().parent.parent)
POLL_S = 0.01
GIL_SAMPLES = 3
GIL_SAMPLE_GAP_S = 0.1


@dataclass
class AttachOptions:
    method: str = "auto"
    settings: dict[str, str] = field(default_factory=dict)  # agent settings (DYNPROF_* names)
    main_thread_wait_s: float = 2.0  # before the fallback (or the refusal) is considered
    ready_timeout_s: float = 30.0  # from the bootstrap running to the agent answering
    fallback: bool = True
    # False: inject even into a process whose agent answers (the bootstrap then finds the agent
    # and reports "already"); for stress tests of the injection itself.
    check_existing: bool = True


@dataclass
class AttachResult:
    pid: int
    status: str  # "attached" or "already" (an agent was there: nothing done)
    method: str  # remote-exec, gdb-pending-call, gdb-gil-state, or none
    seconds: float = 0.0  # request to agent ready
    inject_s: float = 0.0  # how long the injection tool ran (gdb: the target is stopped part of it)
    socket: str | None = None
    log: str | None = None
    python: str | None = None
    executable: str | None = None
    dynprof_file: str | None = None
    activation: str | None = None
    hook_installed: bool | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """What happened, for a person: one line, then any notes."""
        if self.status == "already":
            how = f" (started by {self.activation})" if self.activation else ""
            return f"pid {self.pid}: already has a dynprof agent{how}; nothing done"
        via = {
            "remote-exec": "sys.remote_exec",
            "gdb-pending-call": "gdb, pending call",
            "gdb-gil-state": "gdb, PyGILState fallback",
        }.get(self.method, self.method)
        text = f"pid {self.pid}: attached ({via}, {self.seconds:.2f} s): agent ready, log {self.log}"
        if self.hook_installed is False:
            text += "\n  no optimizer step hook yet (torch.optim not imported): step mode starts once it is"
        for note in self.notes:
            text += f"\n  note: {note}"
        return text


def existing_agent(pid: int) -> AgentRecord | None:
    """The live agent registered for ``pid`` in this user's run directory, if it answers."""
    record = read_record(pid)
    if record is None or not record.is_alive() or not os.path.exists(record.socket):
        return None
    try:
        AgentClient.for_record(record, timeout=2.0).status()
    except errors.DynprofError:
        return None
    return record


def choose_method(pid: int, version: tuple[int, int], requested: str) -> tuple[str, list[str]]:
    """``("remote-exec" | "gdb", notes)`` for a target of ``version``."""
    notes: list[str] = []
    if requested not in METHODS:
        raise errors.UsageError(f"unknown attach method {requested!r} (choose from {', '.join(METHODS)})")
    why_not = _remote.available_for(version)
    disabled = _preflight.remote_debug_disabled(pid) if why_not is None else None
    if requested == "remote-exec":
        if why_not is not None:
            raise errors.Unsupported(f"--method remote-exec is not possible: {why_not}", help="Use --method gdb.")
        if disabled is not None:
            raise errors.Unsupported(
                f"process {pid} refuses sys.remote_exec: {disabled}",
                help="Use --method gdb, which does not depend on that setting.",
            )
        return "remote-exec", notes
    if requested == "auto" and why_not is None and disabled is None:
        return "remote-exec", notes
    if requested == "auto" and version >= (3, 14):
        notes.append(f"sys.remote_exec not used: {why_not or disabled}")
    return "gdb", notes


def attach(pid: int, options: AttachOptions | None = None) -> AttachResult:
    """Start the agent in ``pid`` (a no-op if it has one). Raises a DynprofError with a fix."""
    options = options or AttachOptions()
    t0 = time.monotonic()
    _preflight.check_process(pid)
    record = existing_agent(pid) if options.check_existing else None
    if record is not None:
        return _already(pid, record, t0)
    version = _preflight.target_python(pid)
    method, notes = choose_method(pid, version, options.method)
    gdb = _preflight.find_gdb() if method == "gdb" else ""
    symbols = _preflight.gdb_symbols(pid) if method == "gdb" else {}

    base = run_dir() / "attach"
    ensure_private_dir(base)
    work = base / f"{pid}-{uuid.uuid4().hex[:8]}"
    work.mkdir(mode=0o700)
    settings = {"DYNPROF_RUN_DIR": str(run_dir()), "DYNPROF_ARTIFACT_DIR": str(artifact_dir())}
    settings.update(options.settings)
    try:
        return _attach(pid, options, method, gdb, symbols, work, settings, notes, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _attach(
    pid: int,
    options: AttachOptions,
    method: str,
    gdb: str,
    symbols: dict[str, int],
    work: Path,
    settings: Mapping[str, str],
    notes: list[str],
    t0: float,
) -> AttachResult:
    via = "remote-exec" if method == "remote-exec" else "gdb-pending-call"
    source = _bootstrap.bootstrap_source(str(work), DYNPROF_HOME, settings, via, options.ready_timeout_s)
    text = _bootstrap.payload(source)
    script = work / "payload.py"
    t_inject = time.monotonic()
    session: GdbSession | None = None
    buffer = 0
    if method == "remote-exec":
        script.write_text(text)
        _remote.remote_exec(pid, str(script))
    else:
        data = text.encode() + b"\0"
        script.write_bytes(data)
        session = GdbSession(gdb, pid, symbols)
        buffer = session.queue_pending_call(str(script), len(data))
    inject_s = time.monotonic() - t_inject

    ran = _wait_for(work / _bootstrap.RAN_FILE, pid, options.main_thread_wait_s)
    if ran is None:
        holder = gil_holder(pid)
        if holder == GIL_UNKNOWN:
            raise errors.Timeout(
                f"process {pid}: the main thread did not reach the interpreter within {options.main_thread_wait_s:g} s, "
                "and py-spy could not tell whether a thread holds the GIL, so the fallback was not tried",
                help="The request stays queued and runs when the main thread returns to Python. Install py-spy "
                "(pip install py-spy) to let attach check the GIL and run it now.",
            )
        if holder is not None:
            raise errors.Timeout(
                f"process {pid}: {holder}. No Python code, the agent's included, can run until it returns",
                help="The request stays queued: the agent starts by itself when that call returns "
                "(check with `dynprof ps`, or run `dynprof attach` again). "
                f"`dynprof stacks --pid {pid} --native` shows where it is.",
            )
        if session is None or not options.fallback:
            raise errors.Timeout(
                f"process {pid}: the main thread did not reach the interpreter within {options.main_thread_wait_s:g} s",
                help="The request stays queued and runs when the main thread returns to Python. "
                + ("Use --method gdb to run it now." if session is None else ""),
            )
        notes.append(
            f"the main thread did not reach the interpreter within {options.main_thread_wait_s:g} s and no thread "
            "holds the GIL: ran the bootstrap on it under PyGILState_Ensure"
        )
        via = "gdb-gil-state"
        if not session.run_under_gil_state(buffer):
            raise errors.Timeout(
                f"process {pid}: the main thread held the GIL when gdb stopped it; nothing was run",
                help="The request stays queued and runs at the main thread's next safe point; "
                "run `dynprof attach` again to check.",
            )
        ran = _wait_for(work / _bootstrap.RAN_FILE, pid, options.main_thread_wait_s)
        if ran is None:
            raise errors.Timeout(f"process {pid}: the bootstrap did not start under PyGILState_Ensure")
    result = _wait_for(work / _bootstrap.RESULT_FILE, pid, options.ready_timeout_s)
    if result is None:
        raise errors.Timeout(
            f"process {pid}: the agent did not report within {options.ready_timeout_s:g} s",
            help=f"Look at the agent's log in {run_dir() / 'logs'}/{pid}.log.",
        )
    if not result.get("ok"):
        raise _failure(pid, result)
    confirm_ready(pid, result, options.ready_timeout_s)
    record = read_record(pid)
    out = AttachResult(
        pid=pid,
        status="already" if result.get("already") else "attached",
        method=via,
        seconds=round(time.monotonic() - t0, 3),
        inject_s=round(inject_s, 3),
        socket=result.get("socket"),
        log=result.get("log"),
        python=result.get("python"),
        executable=result.get("executable"),
        dynprof_file=result.get("dynprof_file"),
        activation=record.activation if record is not None else result.get("activation"),
        hook_installed=result.get("hook_installed"),
        notes=notes,
    )
    if record is None:
        out.notes.append(
            f"the agent registered at {result.get('socket')}, outside this run directory ({run_dir()}): "
            "set DYNPROF_RUN_DIR to reach it"
        )
    return out


# How long the agent has to answer its first status request once it said it was ready, and
# how much of its log is read for the reason when it does not.
CONFIRM_TIMEOUT_S = 5.0
LOG_TAIL_BYTES = 64 * 1024


def confirm_ready(pid: int, result: Mapping[str, Any], timeout: float = CONFIRM_TIMEOUT_S) -> None:
    """Ready means answering: one status round trip over the socket the agent reported.

    The bootstrap's word is not enough: an agent whose server thread died (a module it needs
    missing from the job's environment) has bound its socket and registered, but nobody
    serves it. Raises AgentError with the reason from the agent's log when it does not answer."""
    sock = result.get("socket")
    log = result.get("log") or f"{run_dir() / 'logs'}/{pid}.log"
    if not isinstance(sock, str) or not sock:
        raise errors.AgentError(f"process {pid}: the agent started but reported no socket", help=f"See its log: {log}.")
    try:
        AgentClient(pid=pid, sock_path=sock, timeout=min(timeout, CONFIRM_TIMEOUT_S)).status()
    except errors.DynprofError as exc:
        reason = last_error_in_log(str(log))
        raise errors.AgentError(
            f"process {pid}: the agent started but does not answer on its socket ({exc.message})"
            + (f": {reason}" if reason else ""),
            help=f"See its log: {log}. The job goes on without a working agent; `dynprof attach` "
            "again once the cause is fixed finds the registered agent and checks it the same way.",
        ) from None


def last_error_in_log(path: str, max_bytes: int = LOG_TAIL_BYTES) -> str | None:
    """The last ERROR line of an agent log, with the exception that ended its traceback
    (``the agent's server thread failed...: ImportError: ...``); None if there is none."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            lines = fh.read(max_bytes).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for i in range(len(lines) - 1, -1, -1):
        head, sep, message = lines[i].partition(" ERROR ")
        if not sep or not head[:4].isdigit():
            continue
        exc_line = None
        for line in lines[i + 1 :]:
            if line[:4].isdigit():  # the next record
                break
            if line and not line.startswith((" ", "Traceback", "During handling", "The above exception")):
                exc_line = line
        text = message.strip() + (f": {exc_line.strip()}" if exc_line else "")
        return text[:500]
    return None


def _already(pid: int, record: AgentRecord, t0: float) -> AttachResult:
    return AttachResult(
        pid=pid,
        status="already",
        method="none",
        seconds=round(time.monotonic() - t0, 3),
        socket=record.socket,
        log=record.log,
        python=record.python_version,
        activation=record.activation,
    )


def _wait_for(path: Path, pid: int, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            try:
                data: dict[str, Any] = json.loads(path.read_text())
                return data
            except (OSError, ValueError):
                pass
        if _preflight.exited(pid):
            raise errors.ProcessNotFound(f"process {pid} exited during attach")
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


GIL_UNKNOWN = "unknown"


def gil_holder(pid: int) -> str | None:
    """``"thread T holds the GIL in native code: in f (file:line)"`` when one thread keeps the GIL
    across several samples without moving; None when nobody holds it (or it changes hands);
    GIL_UNKNOWN when py-spy cannot tell."""
    from collectors import stacks

    seen: list[tuple[int, str] | None] = []
    for i in range(GIL_SAMPLES):
        if i:
            time.sleep(GIL_SAMPLE_GAP_S)
        try:
            captured = stacks.capture_py_spy(pid, timeout=10.0)
        except stacks.CaptureError:
            return GIL_UNKNOWN
        owner = next((t for t in captured.threads if t.holds_gil), None)
        seen.append(None if owner is None else (owner.tid, stacks.headline(owner.frames)))
    first = seen[0]
    if first is None or any(s != first for s in seen):
        return None
    label = "the main thread" if first[0] == pid else f"thread {first[0]}"
    return f"{label} holds the GIL in native code, {first[1]}"


def _failure(pid: int, result: Mapping[str, Any]) -> errors.DynprofError:
    kind = result.get("kind")
    exe = result.get("executable") or "python"
    error = result.get("error") or "unknown error"
    if kind == "import":
        missing = result.get("missing") or "dynprof"
        package = "protobuf" if str(missing).startswith("google") else ("dynprof" if missing == "dynprof" else missing)
        return errors.Unsupported(
            f"process {pid} cannot import dynprof: {error} (its Python: {exe})",
            help=f"Install it into the job's environment: `{exe} -m pip install {package}`. "
            f"(It also tried this CLI's copy, {DYNPROF_HOME}, at the end of its sys.path.)",
        )
    if kind == "old-dynprof":
        return errors.Unsupported(
            f"process {pid} imports dynprof {result.get('dynprof_version')} from {result.get('dynprof_file')}, "
            f"which predates attach",
            help=f"Upgrade it in the job's environment: `{exe} -m pip install -U dynprof`.",
        )
    log = result.get("log") or f"{run_dir() / 'logs'}/{pid}.log"
    return errors.AgentError(f"process {pid}: the agent did not start: {error}", help=f"See its log: {log}.")
