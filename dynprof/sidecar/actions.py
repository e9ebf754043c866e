"""The actions a node's sidecar takes on request: the CLI's own commands, called for their result.

An action is a CLI command (``ps``, ``start``, ``stacks``, ...) and a JSON object of options.
Only the options listed for the action exist (:data:`ACTIONS`; each action carries a kind's
request, ``Action.request``, and takes that request's ``OPTIONS``, its row made from them; a
unit test holds every row to the command's parser). Each value is checked here for its kind
(:func:`check_options`), then read by the request's own ``from_json`` (the command's
``decode``), so a value the request refuses is the command's usage error, as a value its parser
refuses is. Nothing else can be named: no output path, no ``--attach``, no file of the
sidecar's machine. The kind then collects the request, and the command answers with a
:class:`~dynprof.result.Result`: the answer carries its ``to_json()`` (what the CLI's
``--json`` prints), its exit code and its messages; a :class:`~dynprof.errors.DynprofError`
travels as a structured ``error`` (type, message, help, exit code). Nothing printed is parsed,
and the sidecar builds no argument list: an action that runs in a child process hands it the
checked options as JSON (:meth:`Checked.to_json`). The job-wide form (``hosts``) sends every
node the same options and merges their answers (the command's ``collect_job``).

The sidecar imports no CLI module: ``dynprof serve`` hands it the commands
(:class:`ActionCommand`: the request's reader and the command's ``collect`` functions), and a child
process runs :data:`CHILD_MODULE`, named here as a string only.

Commands run in this process, on a thread of their own, and return their result: nothing they
do touches ``sys.stdout``. ``healthcheck`` runs in a child process: it drives the GPUs and must
not leave CUDA state in the sidecar; so does ``link-test`` (one side of a link test between
nodes, torch.distributed with gloo or NCCL).

The job-level actions (``ps``, ``ls``, ``stacks``, ``start``, ``stop``, ``memory``, ``nccl``)
also take ``hosts``, a list of ``HOST[:PORT]``: the command's ``collect_job`` then reaches
those nodes' sidecars (so the page can ask its own sidecar for a job-wide view). It runs in a
child process too: a job-wide answer merges up to 4096 nodes' answers of up to 64 MiB each,
which must not stay in the sidecar's heap, and the child (with its connections) can be killed
past the action's limit, which a thread cannot. ``hosts`` is not among the action's
``options``: the fan-out forwards exactly those, so the requests it sends to the nodes never
carry ``hosts`` again, and a node collects on its own (one level only, by construction).

Every action has a hard time limit: the command's own ``--timeout`` (capped per action), plus a
grace period. A child process still running past it is killed with its whole process group; a
command running in this process cannot be killed, so its caller is answered (exit code 9, timed
out) and the command keeps its slot of :class:`ActionSlots` until it ends, so a stuck command
can never let more than ``max_actions`` run at once.

    >>> run_action("ps", {"job": "j1"}, commands=table)["result"]["agents"]      # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from collectors.flight_recorder.collect import NcclRequest
from collectors.memory.collect import MemoryPlanRequest, MemoryRequest
from collectors.stacks.collect import StacksRequest
from collectors.torch_trace.collect import TraceRequest
from dynprof import __version__, errors, jsontext
from dynprof.identity import detect
from dynprof.node_requests import LsRequest, PsRequest, StopRequest
from dynprof.procs import kill_group
from dynprof.result import Result, error_json
from healthcheck.collect import HealthcheckRequest
from healthcheck.links.side import LinkTestRequest

log = logging.getLogger("dynprof.sidecar")

API_VERSION = 1
MAX_OUTPUT_BYTES = 64 * 1024 * 1024  # a command's JSON larger than this is refused, not buffered on
MAX_PARAM_CHARS = 4096
MAX_MESSAGES = 200
SUBPROCESS_GRACE_S = 10.0
# The entry point of an action's child process (the CLI's; named, never imported, here).
CHILD_MODULE = "dynprof.cli.sidecar_actions"


@dataclass(frozen=True)
class Option:
    flag: str
    kind: str  # "str", "int", "float", "bool", "ints" (list of integers), "strs"


class Request(Protocol):
    """A kind's request as an action carries it: ``OPTIONS`` (``{name: kind}``, what its
    ``from_json`` reads; :mod:`dynprof.requests`) are the action's options."""

    OPTIONS: ClassVar[dict[str, str]]


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
    failed_exit: int = 1  # the exit code of "could not run" (healthcheck: 3; 1 and 2 are verdicts there)
    leading: tuple[str, ...] = ()  # the command's own positional words first (memory-plan: ``memory plan``)
    # The kind's request the action carries (its options are the request's OPTIONS, plus
    # ``text_options``: how the command prints, no part of the request); None: no request.
    request: type[Request] | None = None
    text_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActionCommand:
    """A CLI command as an action runs it, handed to the sidecar by ``dynprof serve``.

    ``decode`` reads the action's checked options as the kind's request (a refused value is a
    :class:`~dynprof.errors.UsageError`, with the command's usage exit code) and
    ``collect_request`` collects it on this node. ``collect_job`` (job-level commands) answers
    for the given nodes (``hosts``, HOST[:PORT] each), through their sidecars (trusting the CA
    file given), with the same options. No argument list is built on either path."""

    decode: Callable[[dict[str, Any]], Any]
    collect_request: Callable[[Any], Result]
    collect_job: Callable[[dict[str, Any], Sequence[str], str | None], Result] | None = None


HOSTS = "hosts"  # the one option outside Action.options (see the module docstring)
MAX_HOSTS = 4096


@dataclass(frozen=True)
class FanoutConfig:
    """What a sidecar gives its fan-out children to reach the other nodes' sidecars: its own
    token file (the nodes of a job share one token) and, for https, the CA file to trust."""

    token_file: str
    cacert: str | None = None


def _host_key(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _is_loopback_host(host: str) -> bool:
    import ipaddress

    key = _host_key(host)
    if key == "localhost":
        return True
    try:
        return ipaddress.ip_address(key).is_loopback
    except ValueError:
        return False


MIN_LINK_PORT = 1024  # a link test's rendezvous is never on a privileged port
_WILDCARDS = ("0.0.0.0", "::", "")
_LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")  # the standard loopback addresses and name


def own_addresses(bind: str) -> frozenset[str]:
    """The addresses of this machine at which a sidecar bound to ``bind`` listens: that
    address; for a wildcard bind (every address), also the standard loopback addresses and
    ``localhost``; for 127.0.0.1 or ::1, also ``localhost``. Never any other 127.x address:
    other services of the machine listen there."""
    key = _host_key(bind)
    if key in _WILDCARDS:
        return frozenset(_LOOPBACK_NAMES)
    if key in _LOOPBACK_NAMES:
        return frozenset({key, "localhost"})
    return frozenset({key})


@dataclass(frozen=True)
class LinkPolicy:
    """Where this sidecar's ``link-test`` may reach, and where it listens.

    Rank 0's rendezvous listens on ``bind`` (the sidecar's own ``--host``) only; a peer's
    ``store_host`` must be one of the sidecar's own addresses (:func:`own_addresses`: where a
    rendezvous of this machine listens) or of ``peers`` (the Slurm allocation's nodes, this
    machine's names, ``serve --allow-peer``); a sidecar bound to loopback reaches loopback
    addresses only (nothing else can reach it). Any other address of this machine (127.0.0.9,
    say) is another service's, not a peer. Ports are unprivileged (1024-65535). A sidecar
    without a policy (``serve --no-job-wide``) runs no link test at all."""

    bind: str
    peers: frozenset[str] = frozenset()

    @classmethod
    def for_sidecar(cls, bind: str, extra: Iterable[str] = (), env: Mapping[str, str] | None = None) -> LinkPolicy:
        import socket

        from dynprof.job.discovery import SLURM_NODELIST_VARIABLES, expand_nodelist

        env = os.environ if env is None else env
        peers = {_host_key(bind), _host_key(socket.gethostname()), _host_key(detect().host)}
        peers |= {_host_key(h) for h in extra if h.strip()}
        nodelist = next((env[v] for v in SLURM_NODELIST_VARIABLES if env.get(v)), None)
        if nodelist:
            try:
                peers |= {_host_key(h) for h in expand_nodelist(nodelist)}
            except errors.DynprofError:
                pass  # a list this parser refuses allows nothing
        return cls(bind, frozenset(peers))

    @property
    def loopback_only(self) -> bool:
        return _is_loopback_host(self.bind)

    def refusal(self, store_host: Any, store_port: Any) -> str | None:
        """Why a link test toward ``store_host:store_port`` is refused (None: it may run)."""
        if isinstance(store_port, int) and not isinstance(store_port, bool) and store_port < MIN_LINK_PORT:
            return f"link-test: 'store_port' must be {MIN_LINK_PORT}-65535 (no privileged port)"
        if not isinstance(store_host, str):
            return None  # the command's parser refuses it
        key = _host_key(store_host)
        allowed = key in own_addresses(self.bind) or key in self.peers
        if self.loopback_only:
            if not _is_loopback_host(store_host) or not allowed:
                return (
                    f"link-test: this sidecar is bound to loopback ({self.bind}): 'store_host' must be its own "
                    f"loopback address or an allowed peer's (serve --allow-peer), not {store_host[:80]!r}"
                )
            return None
        if allowed:
            return None
        return (
            f"link-test: {store_host[:80]!r} is not a node this sidecar may reach (its own address, the Slurm "
            "allocation's nodes, this machine's name, dynprof serve --allow-peer)"
        )


def _opts(**kinds: str) -> dict[str, Option]:
    return {name: Option("--" + name.replace("_", "-"), kind) for name, kind in kinds.items()}


def _request_action(
    command: str, request: type[Request], *, text_options: dict[str, str] | None = None, **row: Any
) -> Action:
    """The row of an action that carries a kind's request: its options are the request's
    ``OPTIONS`` (one table, the kind's), then ``text_options``, each a flag of its name."""
    text = text_options or {}
    return Action(command, _opts(**request.OPTIONS, **text), request=request, text_options=tuple(text), **row)


ACTIONS: dict[str, Action] = {
    "ps": _request_action(
        "ps", PsRequest, timeout_option="timeout", default_timeout_s=10.0, max_timeout_s=60.0, fans_out=True
    ),
    "ls": _request_action("ls", LsRequest, fans_out=True),
    # `full` is how the text is printed: the document an action answers is the same
    "stacks": _request_action(
        "stacks",
        StacksRequest,
        text_options={"full": "bool"},
        timeout_option="timeout",
        default_timeout_s=15.0,
        max_timeout_s=300.0,
        fans_out=True,
    ),
    "start": _request_action(
        "start",
        TraceRequest,
        timeout_option="timeout",
        default_timeout_s=600.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        own_default_timeout=False,
        fans_out=True,
    ),
    "stop": _request_action(
        "stop",
        StopRequest,
        timeout_option="timeout",
        default_timeout_s=120.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        fans_out=True,
    ),
    "memory": _request_action(
        "memory",
        MemoryRequest,
        timeout_option="timeout",
        default_timeout_s=300.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        fans_out=True,
    ),
    # one optimizer step measured in each target (hooks for that step only), and the plan
    "memory-plan": _request_action(
        "memory",
        MemoryPlanRequest,
        timeout_option="timeout",
        default_timeout_s=300.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        leading=("plan",),
    ),
    "nccl": _request_action(
        "nccl",
        NcclRequest,
        timeout_option="timeout",
        default_timeout_s=15.0,
        max_timeout_s=300.0,
        changes_jobs=True,
        fans_out=True,
    ),
    "healthcheck": _request_action(
        "healthcheck",
        HealthcheckRequest,
        default_timeout_s=900.0,
        max_timeout_s=900.0,
        in_subprocess=True,
        changes_jobs=True,
        failed_exit=3,
    ),
    # one node's side of a link test between nodes (healthcheck.links): in a child, which runs
    # the torch.distributed worker in a process group of its own, killed past --limit
    "link-test": _request_action(
        "link-test",
        LinkTestRequest,
        default_timeout_s=120.0,
        max_timeout_s=900.0,
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

    def __init__(
        self,
        limit: int,
        fanout: FanoutConfig | None = None,
        commands: Mapping[str, ActionCommand] | None = None,
        links: LinkPolicy | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("at least one action slot")
        self.limit = limit
        self.fanout = fanout
        self.commands = commands or {}
        self.links = links
        self._sem = threading.BoundedSemaphore(limit)

    def run(self, name: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """:func:`run_action` in a free slot; :class:`ActionsBusy` when there is none. The
        request is checked first, so a bad one is refused (ActionError) even when all are busy."""
        check_options(name, dict(params or {}), self.fanout, self.links)
        if not self._sem.acquire(blocking=False):
            raise ActionsBusy(f"all {self.limit} action slots are busy")
        return run_action(
            name, params, timeout, release=self._sem.release, fanout=self.fanout, commands=self.commands,
            links=self.links,
        )  # fmt: skip


def effective_timeout(name: str, timeout: float | None) -> float:
    """The seconds an action may take: ``timeout`` (default per action) capped per action."""
    action = ACTIONS[name]
    if timeout is None:
        return action.default_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise ActionError("timeout must be a positive number of seconds")
    return float(min(timeout, action.max_timeout_s))


@dataclass(frozen=True)
class Checked:
    """An action's request once checked: its ``options`` (each of its kind; unset ones left
    out), and for a job-wide one the nodes (``hosts``) and the CA file its child trusts."""

    options: dict[str, Any]
    hosts: tuple[str, ...] | None = None
    cacert: str | None = None

    def to_json(self, name: str) -> dict[str, Any]:
        """The request a child process reads (:data:`CHILD_MODULE`)."""
        hosts = list(self.hosts) if self.hosts is not None else None
        return {"action": name, "options": self.options, "hosts": hosts, "cacert": self.cacert}


def check_options(
    name: str, params: dict[str, Any], fanout: FanoutConfig | None = None, links: LinkPolicy | None = None
) -> Checked:
    """Action ``name``'s options ``params``, checked; :class:`ActionError` on an unknown action
    or option, or a value of the wrong type. ``hosts`` needs ``fanout``; ``link-test`` needs
    ``links`` (and obeys it: its peer, its port; it listens where the policy says, ``bind``)."""
    action = ACTIONS.get(name)
    if action is None:
        raise ActionError(f"unknown action {name!r}; known: {', '.join(sorted(ACTIONS))}")
    if not isinstance(params, dict):
        raise ActionError("the options must be a JSON object")
    params = dict(params)
    hosts = params.pop(HOSTS, None)
    checked_hosts = _check_hosts(name, action, hosts, fanout) if hosts is not None else None
    options: dict[str, Any] = {}
    for key, value in params.items():
        opt = action.options.get(key) if isinstance(key, str) else None
        if opt is None:
            known = ", ".join(sorted(action.options))
            raise ActionError(f"{name}: unknown option {str(key)[:80]!r}; known: {known}")
        checked = _checked(opt, key, value)
        if checked is not None:
            options[key] = checked
    if name == LINK_TEST:
        options["bind"] = _link_bind(params, links)
    cacert = fanout.cacert if checked_hosts is not None and fanout is not None else None
    return Checked(options, checked_hosts, cacert or None)


LINK_TEST = "link-test"


def _link_bind(params: dict[str, Any], links: LinkPolicy | None) -> str:
    """Where rank 0's rendezvous listens (the sidecar's own address) for a link test that
    ``links`` allows; :class:`ActionError` for one it does not."""
    if links is None:
        raise ActionError("this sidecar does not reach other nodes (dynprof serve --no-job-wide): it runs no link test")
    why = links.refusal(params.get("store_host"), params.get("store_port"))
    if why:
        raise ActionError(why)
    return links.bind


def _check_hosts(name: str, action: Action, hosts: Any, fanout: FanoutConfig | None) -> tuple[str, ...]:
    """The nodes of a job-wide action, each checked as the CLI's own --hosts would check it."""
    from dynprof.nodes import parse_node

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
    return tuple(h.strip() for h in hosts)


def _checked(opt: Option, key: str, value: Any) -> Any:
    """``value`` if it is of the option's kind (None: left unset; a list kind takes one item
    for a list of one); :class:`ActionError` if not."""

    def bad(what: str) -> ActionError:
        return ActionError(f"option {key!r} must be {what}")

    if value is None:
        return None
    if opt.kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if opt.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        text = str(value)
    elif opt.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("a number")
        value = float(value)
        text = repr(value)
    elif opt.kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
        text = value
    elif opt.kind in ("ints", "strs"):
        items = value if isinstance(value, list) else [value]
        want = int if opt.kind == "ints" else str
        if not items or any(isinstance(v, bool) or not isinstance(v, want) for v in items):
            raise bad("a list of " + ("integers" if want is int else "strings"))
        value = list(items)
        text = ",".join(str(v) for v in items)
    else:  # pragma: no cover - a table error
        raise bad("known")
    if len(text) > MAX_PARAM_CHARS or "\x00" in text:
        raise bad(f"at most {MAX_PARAM_CHARS} characters, without NUL")
    return value


@dataclass
class Outcome:
    """What an action came to: the fields of its answer."""

    exit_code: int
    result: Any = None  # what the CLI's --json prints (None: the command gave no answer)
    messages: list[str] = field(default_factory=list)  # its stderr lines, as the CLI prints them
    error: dict[str, Any] | None = None  # the DynprofError it stopped on (type, message, help, exit_code)


def run_action(
    name: str,
    params: dict[str, Any] | None = None,
    timeout: float | None = None,
    release: Callable[[], Any] | None = None,
    fanout: FanoutConfig | None = None,
    commands: Mapping[str, ActionCommand] | None = None,
    links: LinkPolicy | None = None,
) -> dict[str, Any]:
    """Run one action and return the sidecar's answer::

        {"api": 1, "action": "ps", "host": "node-3", "dynprof_version": "0.1.0", "exit_code": 0,
         "result": <what `dynprof ps --json` prints, or null>, "messages": [stderr lines],
         "error": null or {"type", "message", "help", "exit_code"}, "elapsed_s": 0.12}

    ``exit_code`` is the CLI's (9 when the action ran past its hard limit). ``timeout``
    (seconds) bounds the whole action: commands that take a ``--timeout`` get it (when the
    caller did not set one; an own ``--timeout`` is capped the same way), a child process is
    killed past it, and an in-process command's caller stops waiting past it plus a grace
    period. ``release`` is called once the command has really ended (its slot). With
    ``hosts``, the command runs in a child process that reaches the nodes with ``fanout``.
    ``commands`` are the CLI's commands (:class:`ActionCommand`), by action name."""
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
        checked = check_options(name, params, fanout, links)
    except BaseException:
        if release is not None:
            release()
        raise
    started = time.monotonic()
    outcome = _outcome(name, action, checked, limit, release, fanout, commands or {})
    return {
        "api": API_VERSION,
        "action": name,
        "host": detect().host,
        "dynprof_version": __version__,
        "exit_code": outcome.exit_code,
        "result": outcome.result,
        "messages": outcome.messages[:MAX_MESSAGES],
        "error": outcome.error,
        "elapsed_s": round(time.monotonic() - started, 3),
    }


def _outcome(
    name: str,
    action: Action,
    checked: Checked,
    limit: float,
    release: Callable[[], Any] | None,
    fanout: FanoutConfig | None,
    commands: Mapping[str, ActionCommand],
) -> Outcome:
    """Read the options as the command's request (``decode``; job-wide too: every node reads
    the same), a refused value answered as the command's usage error; then run it where the action runs:
    in a child process (``in_subprocess``, job-wide), else on a thread of this one."""
    job_wide = checked.hosts is not None
    in_child = action.in_subprocess or job_wide
    released = False
    try:
        command = commands.get(name)
        if command is None:
            return failed(
                errors.Unsupported(
                    f"this sidecar has no command for the action {name!r}",
                    help="Start the sidecar with `dynprof serve`, which hands it the CLI's commands.",
                )
            )
        collect_request = command.collect_request
        try:
            request = command.decode(dict(checked.options))  # job-wide too: the nodes read the same
        except errors.DynprofError as exc:
            return answered_error(exc)
        except Exception as exc:  # a bug in a command's reader must not take the sidecar down
            log.error("dynprof serve: reading the options of %s failed", name, exc_info=exc)
            return failed(errors.DynprofError(f"internal error: {type(exc).__name__}: {exc}"))
        if in_child:
            env = {"DYNPROF_TOKEN_FILE": fanout.token_file} if job_wide and fanout else None
            return _run_child(name, checked, limit, env, action.failed_exit)
        released = True  # from here on, the command's thread gives the slot back when it ends
        return _run_bounded(name, lambda: collect_request(request), limit + SUBPROCESS_GRACE_S, release)
    finally:
        if not released and release is not None:
            release()


# -- answers -------------------------------------------------------------------------------------
def error_lines(exc: errors.DynprofError) -> list[str]:
    """The stderr lines of an error, as the CLI prints them."""
    lines = [f"dynprof: error: {exc.message}"]
    if exc.help:
        lines.append(f"  what to do: {exc.help}")
    return [part for line in lines for part in line.splitlines() if part.strip()]


def failed(exc: errors.DynprofError) -> Outcome:
    """An action that gave no answer of its own (ran past its limit, killed, no such command)."""
    return Outcome(exc.exit_code, None, error_lines(exc), error_json(exc))


def answered_error(exc: errors.DynprofError) -> Outcome:
    """The command stopped on ``exc``: its answer is the CLI's --json error document."""
    doc = error_json(exc)
    return Outcome(exc.exit_code, {"error": doc}, error_lines(exc), doc)


def outcome_of(name: str, result: Any) -> Outcome:
    """The answer of a command's :class:`Result`: its JSON as strict JSON (no NaN, no
    Infinity: every reader takes it), bounded, and its messages as the CLI prints them."""
    if not isinstance(result, Result):
        return failed(errors.DynprofError(f"internal error: {name} answered a {type(result).__name__}, not a Result"))
    try:
        text = jsontext.dumps(result.to_json(), default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        return failed(errors.DynprofError(f"internal error: the answer of {name} is not JSON: {exc}"))
    if len(text) > MAX_OUTPUT_BYTES:
        return failed(
            errors.DynprofError(
                f"the answer of {name} is over {MAX_OUTPUT_BYTES >> 20} MiB: refused",
                help="Narrow the request (--job, --pid), or run the command on the node itself.",
            )
        )
    code = result.exit_code
    if isinstance(code, bool) or not isinstance(code, int):
        code = 1
    return Outcome(code, json.loads(text), _message_lines(result.messages))


def _message_lines(messages: Any) -> list[str]:
    lines: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        first, *more = str(message).splitlines() or [""]
        lines.append(f"dynprof: {first}")
        lines.extend(more)  # continuation lines, as the CLI prints them (not prefixed)
    return [line for line in lines if line.strip()]


def _collected(name: str, call: Callable[[], Result]) -> Outcome:
    """``call()`` (a command's collect) as an answer; nothing escapes."""
    try:
        return outcome_of(name, call())
    except errors.DynprofError as exc:
        return answered_error(exc)
    except SystemExit as exc:  # a command must not exit the sidecar
        code = exc.code if isinstance(exc.code, int) and not isinstance(exc.code, bool) else 1
        return failed(errors.DynprofError(f"internal error: {name} tried to exit ({code})"))
    except Exception as exc:  # a bug in a command must not take the sidecar down
        log.error("dynprof serve: action %s failed", name, exc_info=exc)
        return failed(errors.DynprofError(f"internal error: {type(exc).__name__}: {exc}"))


def _run_bounded(name: str, call: Callable[[], Result], limit: float, release: Callable[[], Any] | None) -> Outcome:
    """``call`` on a thread of its own, waited for at most ``limit`` seconds."""
    box: list[Outcome] = []

    def body() -> None:
        try:
            box.append(_collected(name, call))
        finally:
            if release is not None:
                release()

    worker = threading.Thread(target=body, name=f"dynprof-action-{name}", daemon=True)
    worker.start()
    worker.join(limit)
    if box:
        return box[0]
    return failed(
        errors.Timeout(
            f"{name} ran past {limit:g} s; its answer was abandoned (it keeps its action slot until it ends)",
            help="Give the action a larger timeout, or look at the target: `dynprof stacks` shows where it waits.",
        )
    )


# -- child processes -----------------------------------------------------------------------------
def _run_child(
    name: str,
    checked: Checked,
    timeout: float,
    extra_env: dict[str, str] | None = None,
    failed_exit: int = 1,
) -> Outcome:
    """``python -m CHILD_MODULE`` in a new session, asked (on its stdin) to run the action with
    the ``checked`` options (:meth:`Checked.to_json`); it answers the command's Result as JSON on its stdout. Past ``timeout`` plus the
    grace period, the whole process group is killed (a healthcheck's own workers too)."""
    env = dict(os.environ)
    env.pop("DYNPROF", None)  # the child is a tool, not a job: no agent in it
    env.update(extra_env or {})
    limit = timeout + SUBPROCESS_GRACE_S
    request = json.dumps(checked.to_json(name))
    with _children_lock:
        if _closing:
            return failed(errors.Timeout("the sidecar is stopping"))
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        _children.add(proc)
    try:
        out, err = proc.communicate(request, timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return failed(errors.Timeout(f"{name} ran past {limit:g} s; it and its process group were killed"))
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    finally:
        if proc.poll() is None:  # pragma: no cover - communicate() returned with the child alive
            kill_group(proc)
            proc.wait()
        kill_group(proc)  # workers the child left behind in its group
        with _children_lock:
            _children.discard(proc)
    if _closing and proc.returncode < 0:
        return failed(errors.Timeout("the sidecar stopped while this ran; it was killed"))
    extra = [line for line in err[-65536:].splitlines() if line.strip()]
    if proc.returncode < 0:
        return _killed(name, -proc.returncode, failed_exit, extra)
    outcome = _child_answer(name, out, proc.returncode, failed_exit)
    outcome.messages.extend(extra)
    return outcome


def _killed(name: str, signum: int, exit_code: int, extra: list[str]) -> Outcome:
    try:
        what = signal.Signals(signum).name
    except ValueError:
        what = f"signal {signum}"
    exc = errors.DynprofError(
        f"{name} could not finish: its process was killed by {what} before it answered",
        help="SIGKILL usually means the kernel's out-of-memory killer (see `dmesg`) or an operator; "
        "run it again, or run `dynprof " + name + "` on the node to see it end.",
    )
    exc.exit_code = exit_code
    outcome = failed(exc)
    outcome.messages.extend(extra)
    return outcome


def _child_answer(name: str, out: str, returncode: int, failed_exit: int) -> Outcome:
    """The child's answer (its stdout): ``{"result", "exit_code", "messages", "error"}``."""

    def broken(why: str) -> Outcome:
        exc = errors.DynprofError(f"{name} ended without an answer (exit {returncode}): {why}")
        exc.exit_code = failed_exit
        return failed(exc)

    if len(out) > MAX_OUTPUT_BYTES + 65536:
        return broken(f"its answer is over {MAX_OUTPUT_BYTES >> 20} MiB")
    if not out.strip():
        return broken("it wrote nothing")
    try:
        doc = json.loads(out)
    except (ValueError, RecursionError):
        return broken("its output is not JSON")
    if not isinstance(doc, dict):
        return broken("its output is not a JSON object")
    code = doc.get("exit_code")
    if isinstance(code, bool) or not isinstance(code, int):
        return broken("its answer has no exit code")
    error = doc.get("error")
    if isinstance(error, dict):
        message = str(error.get("message") or "")[:4000]
        help_text = str(error.get("help") or "")[:4000]
        doc_error = {
            "type": str(error.get("type") or "DynprofError")[:100],
            "message": message,
            "help": help_text,
            "exit_code": code,
        }
        return Outcome(code, {"error": doc_error}, error_lines(errors.DynprofError(message, help_text)), doc_error)
    return Outcome(code, doc.get("result"), _message_lines(doc.get("messages")))


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
        kill_group(proc)
    return len(running)
