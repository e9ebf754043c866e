"""The CLI's commands as the sidecar's actions run them.

:func:`action_commands` is the table ``dynprof serve`` hands the sidecar
(:class:`dynprof.sidecar.actions.ActionCommand` per action: the request's reader, and the
command's ``collect_request`` / ``collect_job``), so that the sidecar imports no CLI module.

Run as ``python -m dynprof.cli.sidecar_actions``, it is the child process of an action that
runs apart from the sidecar (healthcheck, link-test; job-wide actions): it reads one request from
stdin, ``{"action": NAME, "options": {...}, "hosts": [HOST[:PORT], ...] or null, "cacert": FILE
or null}`` (the options the sidecar checked), reads the options as the kind's request and
collects it (``collect_request``), or, job-wide, calls the command's ``collect_job(options, nodes,
reach)`` (the same request sent to every node), and writes the :class:`~dynprof.result.Result` on stdout as one
JSON object:
``{"result": to_json(), "exit_code", "messages", "error": null or {type, message, help,
exit_code}}``. Nothing the command renders is written.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from dynprof import errors, jsontext
from dynprof.cli import COMMANDS
from dynprof.nodes import Node, parse_node
from dynprof.result import Result, error_json
from dynprof.sidecar.actions import ACTIONS, MAX_OUTPUT_BYTES, ActionCommand

MAX_REQUEST_CHARS = 1024 * 1024


def load_command(name: str) -> Any:
    """The command object of subcommand ``name`` (as ``dynprof NAME`` builds it)."""
    for command_name, module_name, class_name in COMMANDS:
        if command_name == name:
            return getattr(importlib.import_module(f"dynprof.cli.{module_name}"), class_name)()
    raise KeyError(name)


def action_commands(names: Iterable[str] = ACTIONS) -> dict[str, ActionCommand]:
    """The commands of the sidecar's actions ``names``, by action name."""
    table: dict[str, ActionCommand] = {}
    for name in names:
        command = load_command(ACTIONS[name].command)
        decode, collect_request = command.action_requests()[name]  # every action carries a request
        job = functools.partial(collect_job, command) if hasattr(command, "collect_job") else None
        table[name] = ActionCommand(decode, collect_request, job)
    return table


def collect_job(command: Any, options: dict[str, Any], hosts: Sequence[str], cacert: str | None) -> Result:
    """``command``'s job-wide answer for ``hosts`` (HOST[:PORT] each) with the action's
    ``options``, reaching the nodes' sidecars with the token of $DYNPROF_TOKEN_FILE (the
    sidecar's own) and, for https, trusting ``cacert``."""
    from dynprof.cli.job import Reach, client_of

    nodes: list[Node] = [parse_node(h) for h in hosts]
    return command.collect_job(options, nodes, Reach(client_of(None, cacert)))  # type: ignore[no-any-return]


def answer(name: str, options: dict[str, Any], hosts: list[str] | None, cacert: str | None) -> dict[str, Any]:
    """Run one action's command; its Result (or the error it stopped on) as the child's answer."""
    try:
        command = action_commands([name])[name]
        if hosts is not None:
            if command.collect_job is None:
                raise errors.UsageError(f"{name} runs on this node only")
            command.decode(options)  # a value the request refuses: the usage error, as on a node
            result: Result = command.collect_job(options, hosts, cacert)
        else:
            result = command.collect_request(command.decode(options))
    except errors.DynprofError as exc:
        return {"result": None, "exit_code": exc.exit_code, "messages": [], "error": error_json(exc)}
    return {"result": result.to_json(), "exit_code": result.exit_code, "messages": result.messages, "error": None}


def main() -> int:
    try:
        request = read_request(sys.stdin.read(MAX_REQUEST_CHARS + 1))
    except ValueError as exc:
        print(f"dynprof: bad action request: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the command prints stays out of the answer
    try:
        doc = answer(request["action"], request["options"], request["hosts"], request["cacert"])
    finally:
        sys.stdout = out
    text = jsontext.dumps(doc, default=str)
    if len(text) > MAX_OUTPUT_BYTES:
        too_large = errors.DynprofError(
            f"the answer of {request['action']} is over {MAX_OUTPUT_BYTES >> 20} MiB: refused",
            help="Narrow the request (--job, --pid, fewer hosts).",
        )
        text = jsontext.dumps({"result": None, "exit_code": 1, "messages": [], "error": error_json(too_large)})
    out.write(text)
    out.flush()
    return 0


def read_request(text: str) -> dict[str, Any]:
    """The request a sidecar writes (checked: the child is started by the sidecar alone, but
    a malformed request must end in a message, not a traceback)."""
    if len(text) > MAX_REQUEST_CHARS:
        raise ValueError("over 1 MiB")
    doc = json.loads(text)
    # an action that is not a string (a list, an object) is no known action, not a TypeError
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or doc["action"] not in ACTIONS:
        raise ValueError("no known action")
    options = doc.get("options")
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError("options is not a JSON object")
    hosts = doc.get("hosts")
    if hosts is not None and (not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts)):
        raise ValueError("hosts is not a list of HOST[:PORT]")
    cacert = doc.get("cacert")
    if cacert is not None and not isinstance(cacert, str):
        raise ValueError("cacert is not a file name")
    return {"action": doc["action"], "options": options, "hosts": hosts, "cacert": cacert}


if __name__ == "__main__":
    sys.exit(main())
