"""The actions a node's sidecar takes on request: each the row of a kind's request, collected
here as the CLI collects it, and answered with the kind's answer.

An action is a name of :data:`~dynprof.sidecar.table.ACTIONS` (``ps``, ``start``, ``stacks``,
...) and a JSON object of options. Only the options of the action's row exist (each row carries
a kind's request, ``Action.request``, and takes that request's ``OPTIONS``; a unit test holds
every row to its command's parser). Each value is checked here for its kind
(:func:`check_options`), then read by the row's ``decode`` (the request's own ``from_json``),
so a value the request refuses is the command's usage error, as a value its parser refuses is.
Nothing else can be named: no output path, no ``--attach``, no file of the sidecar's machine.
The row's ``collect`` (the kind's) then answers the request with an answer that owns its codec
(:class:`~dynprof.sidecar.outcome.Answer`): the sidecar sends its ``to_json()`` (what the CLI's
``--json`` prints), its exit code and its messages; a :class:`~dynprof.errors.DynprofError`
travels as a structured ``error`` (type, message, help, exit code). Nothing printed is parsed,
and the sidecar builds no argument list: an action that runs in a child process
(:mod:`dynprof.sidecar.child`) hands it the checked options as JSON (:meth:`Checked.to_json`).
The job-wide form (``hosts``) sends every node the same options and merges their answers (the
row's job-wide function, ``job``). The sidecar imports no CLI module.

Collects run in this process, on a thread of their own, and return their answer: nothing they
do touches ``sys.stdout``. ``healthcheck`` runs in a child process: it drives the GPUs and must
not leave CUDA state in the sidecar; so does ``link-test`` (one side of a link test between
nodes, torch.distributed with gloo or NCCL).

The job-level actions (``ps``, ``ls``, ``stacks``, ``start``, ``stop``, ``memory``, ``nccl``)
also take ``hosts``, a list of ``HOST[:PORT]``: the row's job-wide function then reaches those
nodes' sidecars (so the page can ask its own sidecar for a job-wide view). It runs in a child
process too: a job-wide answer merges up to 4096 nodes' answers of up to 64 MiB each, which
must not stay in the sidecar's heap, and the child (with its connections) can be killed past
the action's limit, which a thread cannot. ``hosts`` is not among the action's ``options``: the
fan-out forwards exactly those, so the requests it sends to the nodes never carry ``hosts``
again, and a node collects on its own (one level only, by construction).

Every action has a hard time limit: the command's own ``--timeout`` (capped per action), plus a
grace period. A child process still running past it is killed with its whole process group; a
collect running in this process cannot be killed, so its caller is answered (exit code 9, timed
out) and the collect keeps its slot of :class:`ActionSlots` until it ends, so a stuck one can
never let more than ``max_actions`` run at once.

    >>> run_action("ps", {"job": "j1"})["result"]["agents"]      # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dynprof import __version__, errors
from dynprof.identity import detect
from dynprof.nodes import parse_node
from dynprof.sidecar.child import SUBPROCESS_GRACE_S, run_child
from dynprof.sidecar.outcome import Answer, Outcome, answered_error, failed, outcome_of
from dynprof.sidecar.policy import FanoutConfig, LinkPolicy
from dynprof.sidecar.table import ACTIONS, Action, Option

log = logging.getLogger("dynprof.sidecar")

API_VERSION = 1
MAX_PARAM_CHARS = 4096
MAX_MESSAGES = 200


HOSTS = "hosts"  # the one option outside Action.options (see the module docstring)
MAX_HOSTS = 4096


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
        table: Mapping[str, Action] | None = None,
        links: LinkPolicy | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("at least one action slot")
        self.limit = limit
        self.fanout = fanout
        self.table = ACTIONS if table is None else table
        self.links = links
        self._sem = threading.BoundedSemaphore(limit)

    def run(self, name: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """:func:`run_action` in a free slot; :class:`ActionsBusy` when there is none. The
        request is checked first, so a bad one is refused (ActionError) even when all are busy."""
        check_options(name, dict(params or {}), self.fanout, self.links)
        if not self._sem.acquire(blocking=False):
            raise ActionsBusy(f"all {self.limit} action slots are busy")
        return run_action(
            name, params, timeout, release=self._sem.release, fanout=self.fanout, table=self.table,
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
        """The request a child process reads (:mod:`dynprof.sidecar.child`)."""
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


def run_action(
    name: str,
    params: dict[str, Any] | None = None,
    timeout: float | None = None,
    release: Callable[[], Any] | None = None,
    fanout: FanoutConfig | None = None,
    table: Mapping[str, Action] | None = None,
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
    ``table`` holds the rows that answer (by default :data:`ACTIONS`; a test's stand-ins)."""
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
    row = (ACTIONS if table is None else table).get(name)
    if row is None:
        if release is not None:
            release()
        outcome = failed(
            errors.Unsupported(
                f"this sidecar has no command for the action {name!r}",
                help="Start the sidecar with `dynprof serve`, which runs every action.",
            )
        )
    else:
        outcome = _outcome(name, row, checked, limit, release, fanout)
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
) -> Outcome:
    """Read the options as the action's request (``decode``; job-wide too: every node reads
    the same), a refused value answered as the command's usage error; then run it where the
    action runs: in a child process (``in_subprocess``, job-wide), else the kind's ``collect``
    on a thread of this one."""
    job_wide = checked.hosts is not None
    in_child = action.in_subprocess or job_wide
    released = False
    try:
        try:
            request = action.decode(dict(checked.options))  # job-wide too: the nodes read the same
        except errors.DynprofError as exc:
            return answered_error(exc)
        except Exception as exc:  # a bug in a request's reader must not take the sidecar down
            log.error("dynprof serve: reading the options of %s failed", name, exc_info=exc)
            return failed(errors.DynprofError(f"internal error: {type(exc).__name__}: {exc}"))
        if in_child:
            env = {"DYNPROF_TOKEN_FILE": fanout.token_file} if job_wide and fanout else None
            return run_child(name, checked, limit, env, action.failed_exit)
        released = True  # from here on, the collect's thread gives the slot back when it ends
        collect = action.collect
        return _run_bounded(name, lambda: collect(request), limit + SUBPROCESS_GRACE_S, release)
    finally:
        if not released and release is not None:
            release()


def _collected(name: str, call: Callable[[], Answer]) -> Outcome:
    """``call()`` (a kind's collect) as an answer; nothing escapes."""
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


def _run_bounded(name: str, call: Callable[[], Answer], limit: float, release: Callable[[], Any] | None) -> Outcome:
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
