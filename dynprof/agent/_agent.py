"""The in-process agent: registration, control socket, step tracking, extensions.

Nothing here imports torch or protobuf on the calling thread: the socket is bound with the
standard library, and the server thread imports the protocol and the command handlers when
it starts. Every failure is caught, logged to ``<run dir>/logs/<pid>.log`` and, for warnings,
to stderr; the job keeps running.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from dynprof import __version__, roles
from dynprof.agent._safety import WATCH as PROFILER_WATCH
from dynprof.agent._safety import watch_when_imported
from dynprof.agent._steps import StepTracker
from dynprof.identity import Identity, detect
from dynprof.kinds import agent_extensions
from dynprof.paths import MAX_SOCKET_PATH, agents_dir, logs_dir
from dynprof.registry import (
    AgentRecord,
    has_agent_children,
    process_start_ticks,
    remove_record,
    socket_path,
    write_record,
)

log = logging.getLogger("dynprof.agent")

# Modules that add capabilities to the agent (the rows of dynprof.kinds that have one, in their
# order). Each has ``install(agent)``; it may register command handlers (agent.handlers[name] =
# fn) and exit callbacks. A module that is missing or fails to install is logged and skipped:
# the rest of the agent still works.
EXTENSIONS = agent_extensions()


class _OneLineFormatter(logging.Formatter):
    """What reaches the job's stderr: one prefixed line per warning, never a traceback.

    The traceback, if any, is in the agent's log file, which the line names.
    """

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.log_path = log_path

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text += f": {type(exc).__name__}: {exc}"
            if self.log_path:
                text += f" (details in {self.log_path})"
        return "dynprof: " + " ".join(text.split("\n"))


class _AgentFileHandler(logging.FileHandler):
    """The agent's log file. A write that fails (a full filesystem, a removed run directory)
    never prints Python's "--- Logging error ---" block into the job's stderr: the first
    failure says so on one dynprof-prefixed line, and the file is given up (later lines are
    counted in ``failures``, not written). Once detached (the agent stopped), nothing is written."""

    def __init__(self, path: str) -> None:
        super().__init__(path, delay=True)
        self.failures = 0
        self.detached = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failures:
            self.failures += 1
            return
        if self.detached:
            return
        try:
            # FileHandler.emit opens the file (delay=True, or again after a detach) outside the
            # try that sends write errors to handleError: a run directory removed meanwhile
            # would raise into whatever thread logged, the training thread included.
            super().emit(record)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failures += 1
        if self.failures > 1:
            return
        exc = sys.exc_info()[1]
        why = getattr(exc, "strerror", None) or (f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error")
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"dynprof: warning: the agent cannot write its log {self.baseFilename} ({why}); "
                "its log lines are dropped from now on\n"
            )
        self._drop_stream()

    def _drop_stream(self) -> None:
        stream, self.stream = self.stream, None  # type: ignore[assignment]
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()

    def flush(self) -> None:
        if not self.failures:
            super().flush()  # an error here reaches emit's handleError

    def detach(self) -> None:
        """Write nothing more and close the file (it opens again on the next ``attach``)."""
        self.detached = True
        self.acquire()
        try:
            self._drop_stream()
        finally:
            self.release()

    def attach(self) -> None:
        self.detached = False


class _AgentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """dynprof's one-line warnings on the job's stderr. If stderr itself cannot be written,
    there is nowhere to say so: the line is dropped, never a "--- Logging error ---" block."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.failures = 0
        self.detached = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.detached:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failures += 1

    def detach(self) -> None:
        self.detached = True

    def attach(self) -> None:
        self.detached = False


def _setup_logging(pid: int) -> str:
    path = ""
    if getattr(log, "_dynprof_configured", False):
        for handler in log.handlers:
            if isinstance(handler, (_AgentFileHandler, _AgentStderrHandler)):
                handler.attach()
        return getattr(log, "_dynprof_log_path", "")
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s %(process)d %(threadName)s %(levelname)s %(message)s")
    try:
        path = str(logs_dir() / f"{pid}.log")
        fh = _AgentFileHandler(path)
        fh.setFormatter(fmt)
        log.addHandler(fh)
    except Exception:
        path = ""
    err = _AgentStderrHandler()
    err.setLevel(logging.WARNING)
    err.setFormatter(_OneLineFormatter(path))
    log.addHandler(err)
    log._dynprof_configured = True  # type: ignore[attr-defined]
    log._dynprof_log_path = path  # type: ignore[attr-defined]
    return path


def _detach_logging() -> None:
    """After the agent stopped, its threads (a server thread finishing, a watch that wakes up)
    log nowhere: not into the job's stderr, not after "agent stopped" in its log."""
    for handler in log.handlers:
        if isinstance(handler, (_AgentFileHandler, _AgentStderrHandler)):
            with contextlib.suppress(Exception):
                handler.detach()


class Agent:
    def __init__(self, activation: str, options: dict[str, Any] | None = None) -> None:
        self.pid = os.getpid()
        self.activation = activation
        self.options = dict(options or {})
        self._identity: Identity = detect()
        self.started_at = time.time()
        self.steps = StepTracker()
        self.handlers: dict[str, Callable[[Any], tuple[str, Any]]] = {}
        self.exit_callbacks: list[Callable[[], None]] = []
        self.extensions: dict[str, Any] = {}
        self.record: AgentRecord | None = None
        self.log_path = ""
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._role = roles.OTHER

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.log_path = _setup_logging(self.pid)
        directory = agents_dir()
        path = str(socket_path(self.pid, directory))
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; set a shorter DYNPROF_RUN_DIR")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        sock.listen(64)
        self._sock = sock
        self._role = self._own_role(stepped=False)  # a launcher knows at once
        self.record = self._make_record(path)
        self.steps.on_install = self._on_torch_imported
        self.steps.install()
        self._watch_process_group()
        self._thread = threading.Thread(target=self._run_server, name="dynprof-agent", daemon=True)
        self._thread.start()
        write_record(self.record, directory)
        atexit.register(self.stop)
        self._withdraw_from_dataloader_workers()
        log.info(
            "agent started (%s) pid=%d rank=%s job=%s socket=%s",
            self.activation,
            self.pid,
            self.identity.rank,
            self.identity.job_id,
            path,
        )

    def _withdraw_from_dataloader_workers(self) -> None:
        """A process started by multiprocessing's spawn method is, by the time its target runs,
        a DataLoader worker, a rank (``torch.multiprocessing.spawn``) or a helper: which, only the
        target tells. So, in such a process only, the agent looks at the target once, as the
        child starts it (multiprocessing runs no after-fork callbacks in spawned children):
        ``BaseProcess._bootstrap`` is wrapped until its first call, which puts the original back
        before anything else. A DataLoader worker's agent then stops and unregisters, before
        the worker loop runs, so no command ever finds it. Forked workers drop the agent at
        fork (below)."""
        if not roles.is_mp_child_cmdline(getattr(sys, "orig_argv", sys.argv)):
            return
        try:
            from multiprocessing import process

            if process.parent_process() is not None:
                return  # the target already runs (an agent attached later): nothing to wrap

            base: Any = process.BaseProcess
            original = base._bootstrap
            agent = self

            def _bootstrap(proc: Any, *args: Any, **kwargs: Any) -> Any:
                base._bootstrap = original
                _withdraw_if_dataloader_worker(agent, proc)
                return original(proc, *args, **kwargs)

            base._bootstrap = _bootstrap
        except Exception:
            log.exception("watching for a DataLoader worker's start failed")

    def _watch_process_group(self) -> None:
        """Wrap init_process_group before the job can call it (see ``_pg_watch``); the
        job-store extension listens. A failure only costs the job-store registration."""
        try:
            from dynprof.agent._pg_watch import WATCH

            WATCH.install()
        except Exception:
            log.exception("watching for the process group failed")

    def _make_record(self, sock_path: str) -> AgentRecord:
        torch = sys.modules.get("torch")
        return AgentRecord(
            pid=self.pid,
            ppid=os.getppid(),
            host=self.identity.host,
            rank=self.identity.rank,
            local_rank=self.identity.local_rank,
            world_size=self.identity.world_size,
            job_id=self.identity.job_id,
            cmdline=list(sys.orig_argv) if hasattr(sys, "orig_argv") else [sys.executable, *sys.argv],
            python_version=sys.version.split()[0],
            torch_version=getattr(torch, "__version__", None) if torch else None,
            dynprof_version=__version__,
            started_at=self.started_at,
            start_ticks=process_start_ticks(self.pid),
            socket=sock_path,
            log=self.log_path,
            activation=self.activation,
            extra={k: v for k, v in self.options.items() if isinstance(v, (int, float, str, bool))},
            role=self._role,
        )

    def _run_server(self) -> None:
        try:
            from dynprof.agent._server import ControlServer

            self._load_extensions()
            assert self._sock is not None and self.record is not None
            server = ControlServer(self._sock, self.record.socket, self.handlers)
            self._server = server
            if self._stopped:  # stop() ran while the extensions loaded, and closed the bare socket
                server.close()
                return
            self._ready.set()
            server.serve_forever()
        except BaseException:
            log.exception("the agent's server thread failed; the job continues without it")
        finally:
            self._ready.set()

    def _load_extensions(self) -> None:
        from dynprof.agent._core_handlers import install as install_core

        install_core(self)
        for name in EXTENSIONS:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name == name:
                    continue
                log.exception("agent extension %s failed to import", name)
                continue
            except Exception:
                log.exception("agent extension %s failed to import", name)
                continue
            try:
                self.extensions[name] = module.install(self)
            except Exception:
                log.exception("agent extension %s failed to install", name)

    def wait_ready(self, timeout: float = 10.0) -> bool:
        return self._ready.wait(timeout)

    def stop(self) -> None:
        """Flush captures in progress and unregister. Runs at interpreter exit."""
        if self._stopped or os.getpid() != self.pid:
            return
        self._stopped = True
        for callback in reversed(self.exit_callbacks):
            try:
                callback()
            except Exception:
                log.exception("exit callback failed")
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self.steps.uninstall()
        remove_record(self.pid)
        log.info("agent stopped")
        _detach_logging()

    # -- identity ------------------------------------------------------------------------------
    @property
    def identity(self) -> Identity:
        """Who this process is, read again on each use (never on the training hot path).

        Launchers such as ``torch.multiprocessing.spawn`` set RANK/WORLD_SIZE in the child
        after it started, and torch.distributed knows the rank once the process group exists:
        both win over what the environment said at start-up. The record follows.
        """
        try:
            ident = detect()
            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_available() and dist.is_initialized():
                ident = replace(ident, rank=dist.get_rank(), world_size=dist.get_world_size())
        except Exception:
            return self._identity
        if ident != self._identity:
            self._identity = ident
            self._update_record()
        return ident

    @property
    def role(self) -> str:
        """What this process is in its job (see ``dynprof.roles``), decided again on each use
        (never on the training hot path); the record follows a change."""
        steps = self.steps
        role = self._own_role(stepped=steps.step > 0 or steps.optimizer_steps > 0)
        if role != self._role:
            log.info("role: %s (was %s)", role, self._role)
            self._role = role
            self._update_record()
        return role

    def _own_role(self, stepped: bool) -> str:
        ident = self.identity
        return roles.own_role(
            stepped,
            ident.rank,
            ident.job_id,
            has_agent_children=lambda: has_agent_children(os.getpid(), ident.job_id, ident.rank),
        )

    def _on_torch_imported(self) -> None:
        """torch.optim was just imported (so torch is): record torch's version, and watch for
        the job's own profilers (see ``_safety.ProfilerWatch``)."""
        PROFILER_WATCH.install()
        watch_when_imported()  # torch.profiler may be imported later than torch.optim
        self._update_record()

    def _update_record(self) -> None:
        record = self.record
        if record is None or self._stopped:  # a stopped agent's record is gone and stays gone
            return
        ident = self._identity
        record.rank, record.local_rank, record.world_size = ident.rank, ident.local_rank, ident.world_size
        record.job_id, record.host = ident.job_id, ident.host
        record.role = self._role
        torch = sys.modules.get("torch")
        record.torch_version = getattr(torch, "__version__", None) if torch else None
        try:
            write_record(record)
        except Exception:
            log.exception("updating the registration record failed")

    # -- state for the Status reply -----------------------------------------------------------
    def cuda_initialized(self) -> bool:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        try:
            return bool(torch.cuda.is_initialized())
        except Exception:
            return False


_agent: Agent | None = None
_agent_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) is not the process the agent describes:
    # it inherits the agent object but no server thread. Forget it; the parent's record stays.
    global _agent
    agent = _agent
    _agent = None
    if agent is not None:
        agent._stopped = True
        agent.steps.uninstall()
        if agent._sock is not None:
            with contextlib.suppress(OSError):
                agent._sock.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _withdraw_if_dataloader_worker(agent: Agent, proc: Any) -> None:
    # Called in a spawned child right before multiprocessing runs its target.
    try:
        if not roles.is_dataloader_target(getattr(proc, "_target", None)):
            return
        log.info("a DataLoader worker: the agent stops and unregisters (no command targets a worker)")
        if get() is agent:
            shutdown()
        else:
            agent.stop()
    except Exception:
        log.exception("stopping the agent of a DataLoader worker failed")


def start(activation: str = "api", **options: Any) -> Agent | None:
    """Start the agent in this process (idempotent). Returns it, or None if it could not start.

    Never raises: a failure is logged and reported on stderr, and the job goes on.
    """
    global _agent
    with _agent_lock:
        if _agent is not None and _agent.pid == os.getpid():
            return _agent
        agent = Agent(activation, options)
        try:
            agent.start()
        except Exception as exc:
            log.info("agent failed to start", exc_info=True)  # the log file only: one line below
            with contextlib.suppress(Exception):
                sys.stderr.write(f"dynprof: agent not started: {type(exc).__name__}: {exc}\n")
            with contextlib.suppress(Exception):
                agent.stop()
            return None
        _agent = agent
        return agent


def get() -> Agent | None:
    agent = _agent
    return agent if agent is not None and agent.pid == os.getpid() else None


def shutdown() -> None:
    global _agent
    with _agent_lock:
        agent, _agent = _agent, None
    if agent is not None:
        agent.stop()
        with contextlib.suppress(ValueError):
            atexit.unregister(agent.stop)
