"""The actions a node's sidecar takes on request: the CLI's own commands, run with ``--json``.

An action is a CLI command (``ps``, ``start``, ``stacks``, ...) and a JSON object of options.
Only the options listed for the action exist; each becomes one ``--flag=value`` and is checked
by the command's own parser, so the sidecar accepts exactly what the CLI accepts and answers
exactly what the CLI's ``--json`` prints. Nothing else can be named: no output path, no
``--attach``, no file of the sidecar's machine.

Commands run in this process, on the calling thread, with their stdout and stderr captured for
that thread alone (and for the threads it starts through :func:`dynprof.cli._common.parallel`),
so concurrent actions never mix their output. ``healthcheck`` runs in a child process: it drives
the GPUs and must not leave CUDA state in the sidecar.

The job-level actions (``ps``, ``ls``, ``stacks``, ``start``, ``stop``, ``memory``, ``nccl``)
also take ``hosts``, a list of ``HOST[:PORT]``: the command then runs in a child process with
``--hosts`` and reaches those nodes' sidecars itself (so the page can ask its own sidecar for a
job-wide view). ``hosts`` is not among the action's ``options``: the fan-out forwards exactly
those, so the requests it sends to the nodes never carry ``hosts`` again (one level only), and
a command running in this process never fans out (:func:`in_action`).

Every action has a hard time limit: the command's own ``--timeout`` (capped per action), plus a
grace period. A child process still running past it is killed with its whole process group; a
command running in this process cannot be killed, so its caller is answered (exit code 9, timed
out) and the command keeps its slot of :class:`ActionSlots` until it ends, so a stuck command
can never let more than ``max_actions`` run at once.

    >>> run_action("ps", {"job": "j1"})["result"]["agents"]      # doctest: +SKIP
"""

from __future__ import annotations

import contextvars
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from dynprof import __version__
from dynprof.identity import detect

API_VERSION = 1
MAX_OUTPUT_BYTES = 64 * 1024 * 1024  # a command's JSON larger than this is refused, not buffered on
MAX_PARAM_CHARS = 4096
SUBPROCESS_GRACE_S = 10.0


@dataclass(frozen=True)
class Option:
    flag: str
    kind: str  # "str", "int", "float", "bool", "ints" (list of integers), "strs"


@dataclass(frozen=True)
class Action:
    command: str
    options: dict[str, Option]
    timeout_option: str | None = None  # the option that bounds the command's own waiting
    default_timeout_s: float = 60.0
    max_timeout_s: float = 3600.0
    in_subprocess: bool = False
    changes_jobs: bool = False  # acts on a job (a trace, a snapshot): refused by a read-only sidecar
    own_default_timeout: bool = True  # the command's --timeout has a default of its own
    fans_out: bool = False  # takes ``hosts`` (the command's --hosts): a job-wide view through the sidecars


HOSTS = "hosts"  # the one option outside Action.options (see the module docstring)
MAX_HOSTS = 4096


@dataclass(frozen=True)
class FanoutConfig:
    """What a sidecar gives its fan-out children to reach the other nodes' sidecars: its own
    token file (the nodes of a job share one token) and, for https, the CA file to trust."""

    token_file: str
    cacert: str | None = None


def _opts(**kinds: str) -> dict[str, Option]:
    return {name: Option("--" + name.replace("_", "-"), kind) for name, kind in kinds.items()}


_TARGETS = {"job": "str", "pid": "ints", "all": "bool"}

ACTIONS: dict[str, Action] = {
    "ps": Action("ps", _opts(job="str", timeout="float"), "timeout", 10.0, 60.0, fans_out=True),
    "ls": Action("ls", _opts(job="str", kind="str", limit="int", all="bool"), fans_out=True),
    "stacks": Action(
        "stacks",
        _opts(**_TARGETS, native="bool", locals="bool", method="str", timeout="float", no_save="bool", full="bool"),
        "timeout",
        15.0,
        300.0,
        fans_out=True,
    ),
    "start": Action(
        "start",
        _opts(
            **_TARGETS,
            steps="int",
            duration="float",
            at_step="int",
            record_shapes="bool",
            with_stack="bool",
            profile_memory="bool",
            with_flops="bool",
            with_modules="bool",
            activities="strs",
            max_duration="float",
            no_wait="bool",
            timeout="float",
        ),
        "timeout",
        600.0,
        3600.0,
        changes_jobs=True,
        own_default_timeout=False,
        fans_out=True,
    ),
    "stop": Action(
        "stop",
        _opts(**_TARGETS, no_wait="bool", timeout="float"),
        "timeout",
        120.0,
        3600.0,
        changes_jobs=True,
        fans_out=True,
    ),
    "memory": Action(
        "memory",
        _opts(**_TARGETS, history_start="int", history_stop="bool", stacks="str", timeout="float"),
        "timeout",
        300.0,
        3600.0,
        changes_jobs=True,
        fans_out=True,
    ),
    "nccl": Action(
        "nccl",
        _opts(**_TARGETS, only_active="bool", no_stack_traces="bool", timeout="float"),
        "timeout",
        15.0,
        300.0,
        changes_jobs=True,
        fans_out=True,
    ),
    "healthcheck": Action(
        "healthcheck",
        _opts(level="str", backend="str", expect_devices="int", skip="strs", timeout_scale="float", no_save="bool"),
        None,
        900.0,
        900.0,
        in_subprocess=True,
        changes_jobs=True,
    ),
}


class ActionError(Exception):
    """A request the sidecar refuses before running anything (HTTP 400)."""


class ActionsBusy(Exception):
    """Every action slot is taken (HTTP 429)."""


class ActionSlots:
    """At most ``limit`` actions at once; one more is refused at once, never queued (a queue of
    requests behind a hung rank's stacks would only grow)."""

    def __init__(self, limit: int, fanout: FanoutConfig | None = None) -> None:
        if limit < 1:
            raise ValueError("at least one action slot")
        self.limit = limit
        self.fanout = fanout
        self._sem = threading.BoundedSemaphore(limit)

    def run(self, name: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """:func:`run_action` in a free slot; :class:`ActionsBusy` when there is none. The
        request is checked first, so a bad one is refused (ActionError) even when all are busy."""
        argv_for(name, dict(params or {}), self.fanout)
        if not self._sem.acquire(blocking=False):
            raise ActionsBusy(f"all {self.limit} action slots are busy")
        return run_action(name, params, timeout, release=self._sem.release, fanout=self.fanout)


def effective_timeout(name: str, timeout: float | None) -> float:
    """The seconds an action may take: ``timeout`` (default per action) capped per action."""
    action = ACTIONS[name]
    if timeout is None:
        return action.default_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ActionError("timeout must be a positive number of seconds")
    return float(min(timeout, action.max_timeout_s))


def argv_for(name: str, params: dict[str, Any], fanout: FanoutConfig | None = None) -> list[str]:
    """The CLI argument list for action ``name`` with ``params``; :class:`ActionError` on an
    unknown action or option, or a value of the wrong type. ``hosts`` needs ``fanout``."""
    action = ACTIONS.get(name)
    if action is None:
        raise ActionError(f"unknown action {name!r}; known: {', '.join(sorted(ACTIONS))}")
    if not isinstance(params, dict):
        raise ActionError("the options must be a JSON object")
    argv = [action.command]
    params = dict(params)
    hosts = params.pop(HOSTS, None)
    if hosts is not None:
        argv.extend(_hosts_args(name, action, hosts, fanout))
    for key, value in params.items():
        opt = action.options.get(key) if isinstance(key, str) else None
        if opt is None:
            known = ", ".join(sorted(action.options))
            raise ActionError(f"{name}: unknown option {str(key)[:80]!r}; known: {known}")
        argv.extend(_flag(opt, key, value))
    argv.append("--json")
    return argv


def _hosts_args(name: str, action: Action, hosts: Any, fanout: FanoutConfig | None) -> list[str]:
    """``--hosts=A,B`` (and ``--cacert``) for a job-wide action; every node checked as the CLI's
    own --hosts would check it."""
    from dynprof import errors
    from dynprof.job.discovery import parse_node

    if not action.fans_out:
        raise ActionError(f"{name}: unknown option 'hosts' ({name} runs on this node only)")
    if not isinstance(hosts, list) or not hosts or any(not isinstance(h, str) for h in hosts):
        raise ActionError("option 'hosts' must be a non-empty list of strings, HOST[:PORT] each")
    if len(hosts) > MAX_HOSTS:
        raise ActionError(f"option 'hosts': at most {MAX_HOSTS} nodes")
    for h in hosts:
        if "," in h or len(h) > 300:
            raise ActionError(f"option 'hosts': one HOST[:PORT] per item, not {h[:80]!r}")
        try:
            parse_node(h)
        except errors.DynprofError as exc:
            raise ActionError(f"option 'hosts': {exc.message}") from None
    if fanout is None:
        raise ActionError("this sidecar does not reach other nodes (dynprof serve --no-job-wide): drop 'hosts'")
    argv = [f"--hosts={','.join(h.strip() for h in hosts)}"]
    if fanout.cacert:
        argv.append(f"--cacert={fanout.cacert}")
    return argv


def _flag(opt: Option, key: str, value: Any) -> list[str]:
    def bad(what: str) -> ActionError:
        return ActionError(f"option {key!r} must be {what}")

    if value is None:
        return []
    if opt.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return [opt.flag] if value else []
    if opt.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        text = str(value)
    elif opt.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        text = repr(float(value))
    elif opt.kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
        text = value
    elif opt.kind in ("ints", "strs"):
        items = value if isinstance(value, list) else [value]
        want = int if opt.kind == "ints" else str
        if not items or any(isinstance(v, bool) or not isinstance(v, want) for v in items):
            raise bad("a list of " + ("integers" if want is int else "strings"))
        text = ",".join(str(v) for v in items)
    else:  # pragma: no cover - a table error
        raise bad("known")
    if len(text) > MAX_PARAM_CHARS or "\x00" in text:
        raise bad(f"at most {MAX_PARAM_CHARS} characters, without NUL")
    return [f"{opt.flag}={text}"]  # one argument: a value can never be read as another flag


def run_action(
    name: str,
    params: dict[str, Any] | None = None,
    timeout: float | None = None,
    release: Callable[[], Any] | None = None,
    fanout: FanoutConfig | None = None,
) -> dict[str, Any]:
    """Run one action and return the sidecar's answer::

        {"api": 1, "action": "ps", "host": "node-3", "exit_code": 0,
         "result": <what `dynprof ps --json` prints, or null>, "messages": [stderr lines],
         "elapsed_s": 0.12}

    ``exit_code`` is the CLI's (9 when the action ran past its hard limit). ``timeout``
    (seconds) bounds the whole action: commands that take a ``--timeout`` get it (when the
    caller did not set one; an own ``--timeout`` is capped the same way), a child process is
    killed past it, and an in-process command's caller stops waiting past it plus a grace
    period. ``release`` is called once the command has really ended (its slot). With
    ``hosts``, the command runs in a child process that reaches the nodes with ``fanout``."""
    try:
        params = dict(params or {})
        action = ACTIONS.get(name)
        if action is None:
            raise ActionError(f"unknown action {name!r}; known: {', '.join(sorted(ACTIONS))}")
        limit = effective_timeout(name, timeout)
        if action.timeout_option:
            own = params.get(action.timeout_option)
            if own is None:
                # the command's own default stands, unless the caller set a limit or it has none
                if timeout is not None or not action.own_default_timeout:
                    params[action.timeout_option] = limit
            elif not isinstance(own, bool) and isinstance(own, (int, float)):
                params[action.timeout_option] = effective_timeout(name, own)
                limit = max(limit, params[action.timeout_option])
        argv = argv_for(name, params, fanout)
        job_wide = params.get(HOSTS) is not None
    except BaseException:
        if release is not None:
            release()
        raise
    started = time.monotonic()
    if action.in_subprocess or job_wide:
        env = {"DYNPROF_TOKEN_FILE": fanout.token_file} if job_wide and fanout else None
        try:
            code, out, err = _run_child(argv, limit, env)
        finally:
            if release is not None:
                release()
    else:
        code, out, err = _run_bounded(argv, limit + SUBPROCESS_GRACE_S, release)
    result: Any = None
    if out.strip():
        try:
            result = json.loads(out)
        except ValueError:
            err += "dynprof: the command's output was not JSON\n"
            code = code or 1
    return {
        "api": API_VERSION,
        "action": name,
        "host": detect().host,
        "dynprof_version": __version__,
        "exit_code": code,
        "result": result,
        "messages": [line for line in err.splitlines() if line.strip()][:200],
        "elapsed_s": round(time.monotonic() - started, 3),
    }


# -- output capture ------------------------------------------------------------------------------
_SINK: contextvars.ContextVar[tuple[io.StringIO, io.StringIO] | None] = contextvars.ContextVar(
    "dynprof_output_sink", default=None
)
_install_lock = threading.Lock()


class _Routed(io.TextIOBase):
    """A stand-in for sys.stdout / sys.stderr: writes go to the current context's buffer when
    one is set (an action running), else to the real stream."""

    def __init__(self, real: TextIO, index: int) -> None:
        self._real = real
        self._index = index

    def _target(self) -> Any:
        sink = _SINK.get()
        return sink[self._index] if sink is not None else self._real

    def write(self, text: str) -> int:
        target = self._target()
        if target is not self._real and target.tell() > MAX_OUTPUT_BYTES:
            raise OSError("dynprof: action output over the limit")
        return int(target.write(text))

    def flush(self) -> None:
        target = self._target()
        if target is self._real:
            target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False if _SINK.get() is not None else self._real.isatty()

    def fileno(self) -> int:
        if _SINK.get() is not None:
            raise io.UnsupportedOperation("captured output has no file descriptor")
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._real, "encoding", "utf-8") or "utf-8"


def in_action() -> bool:
    """True while a command runs as a sidecar's action (on this thread or one it started): such
    a command acts on its own node only, never fanning out again."""
    return _SINK.get() is not None


def install_capture() -> None:
    """Route sys.stdout and sys.stderr through per-context buffers (idempotent)."""
    with _install_lock:
        if not isinstance(sys.stdout, _Routed):
            sys.stdout = _Routed(sys.stdout, 0)  # type: ignore[assignment]
        if not isinstance(sys.stderr, _Routed):
            sys.stderr = _Routed(sys.stderr, 1)  # type: ignore[assignment]


def run_captured(argv: list[str]) -> tuple[int, str, str]:
    """Run ``dynprof ARGV`` in this process; (exit code, stdout, stderr) of this call alone."""
    from dynprof.cli import main

    install_capture()
    out, err = io.StringIO(), io.StringIO()
    ctx = contextvars.copy_context()

    def call() -> int:
        _SINK.set((out, err))
        try:
            return main(argv)
        except SystemExit as exc:  # argparse: a bad value
            return exc.code if isinstance(exc.code, int) else 2
        except Exception as exc:  # a bug in a command must not take the sidecar down
            err.write(f"dynprof: internal error: {type(exc).__name__}: {exc}\n")
            return 1

    code = ctx.run(call)
    return code, out.getvalue(), err.getvalue()


def _run_bounded(argv: list[str], limit: float, release: Callable[[], Any] | None) -> tuple[int, str, str]:
    """:func:`run_captured` on a thread of its own, waited for at most ``limit`` seconds."""
    box: list[tuple[int, str, str]] = []
    ctx = contextvars.copy_context()

    def body() -> None:
        try:
            box.append(ctx.run(run_captured, argv))
        finally:
            if release is not None:
                release()

    worker = threading.Thread(target=body, name=f"dynprof-action-{argv[0]}", daemon=True)
    worker.start()
    worker.join(limit)
    if box:
        return box[0]
    return (
        9,
        "",
        f"dynprof: {argv[0]} ran past {limit:g} s; its answer was abandoned (it keeps its action slot until it ends)\n",
    )


def _run_child(argv: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``python -m dynprof ARGV`` in a new session; past ``timeout`` plus the grace period, the
    whole process group is killed (a healthcheck's own workers too), not just the child."""
    env = dict(os.environ)
    env.pop("DYNPROF", None)  # the child is a tool, not a job: no agent in it
    env.update(extra_env or {})
    limit = timeout + SUBPROCESS_GRACE_S
    with _children_lock:
        if _closing:
            return 9, "", "dynprof: the sidecar is stopping\n"
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynprof", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _children.add(proc)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        return 9, "", f"dynprof: {argv[0]} ran past {limit:g} s; it and its process group were killed\n"
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        if proc.poll() is None:  # pragma: no cover - communicate() returned with the child alive
            _kill_group(proc)
            proc.wait()
        _kill_group(proc)  # workers the child left behind in its group
        with _children_lock:
            _children.discard(proc)
    if _closing and proc.returncode < 0:
        return 9, "", "dynprof: the sidecar stopped while this ran; it was killed\n"
    return proc.returncode, out[:MAX_OUTPUT_BYTES], err[-65536:]


_children: set[subprocess.Popen[str]] = set()
_children_lock = threading.Lock()
_closing = False


def kill_children() -> int:
    """Kill the process groups of the actions' child processes still running (the sidecar is
    stopping: a healthcheck must not outlive it); no new ones start. Returns how many."""
    global _closing
    with _children_lock:
        _closing = True
        running = list(_children)
    for proc in running:
        _kill_group(proc)
    return len(running)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
