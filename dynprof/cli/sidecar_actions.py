"""The CLI's commands as the sidecar's actions run them.

:func:`action_commands` is the table ``dynprof serve`` hands the sidecar
(:class:`dynprof.sidecar.actions.ActionCommand` per action: the command's own parser, and its
``collect_local`` / ``collect_nodes``), so that the sidecar imports no CLI module.

Run as ``python -m dynprof.cli.sidecar_actions``, it is the child process of an action that
runs apart from the sidecar (healthcheck; job-wide actions): it reads one request from stdin,
``{"action": NAME, "argv": [NAME, "--flag=value", ...], "job_wide": bool}``, calls the
command's ``collect_local(args)``, or ``collect_nodes(args, nodes)`` for a job-wide one, and
writes the :class:`~dynprof.result.Result` on stdout as one JSON object:
``{"result": to_json(), "exit_code", "messages", "error": null or {type, message, help,
exit_code}}``. Nothing the command renders is written.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from dynprof import errors, jsontext
from dynprof.cli import COMMANDS
from dynprof.nodes import Node, parse_hosts
from dynprof.result import Result, error_json
from dynprof.sidecar.actions import ACTIONS, MAX_OUTPUT_BYTES, ActionCommand

MAX_REQUEST_CHARS = 1024 * 1024


def load_command(name: str) -> Any:
    """The command object of subcommand ``name`` (as ``dynprof NAME`` builds it)."""
    for command_name, module_name, class_name in COMMANDS:
        if command_name == name:
            return getattr(importlib.import_module(f"dynprof.cli.{module_name}"), class_name)()
    raise KeyError(name)


def command_parser(name: str, command: Any) -> argparse.ArgumentParser:
    """The parser of ``dynprof NAME``, as the CLI builds it."""
    parser = argparse.ArgumentParser(prog=f"dynprof {name}")
    command.prepare_parser(parser)
    return parser


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_options(name: str, command: Any, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the command's own parser; a refused value is a usage error with the
    command's own usage exit code (2; healthcheck's 3), and nothing is printed."""
    parser = command_parser(name, command)

    def refuse(status: int = 0, message: str | None = None) -> NoReturn:
        raise _Refused(status, (message or "").strip())

    # argparse's error() prints the usage, then exits with the parser's usage code (the
    # command may have its own, as healthcheck does): neither happens here.
    parser.print_usage = lambda file=None: None  # type: ignore[method-assign]
    parser.exit = refuse  # type: ignore[method-assign]
    try:
        return parser.parse_args(argv)
    except _Refused as exc:
        message = exc.message.removeprefix(f"{parser.prog}: error: ")
        error = errors.UsageError(f"{name}: {message}", help=f"See `dynprof {name} --help`.")
        error.exit_code = exc.status or 2
        raise error from None


def action_commands(names: Iterable[str] = ACTIONS) -> dict[str, ActionCommand]:
    """The commands of the sidecar's actions ``names``, by action name."""
    table: dict[str, ActionCommand] = {}
    for name in names:
        command_name = ACTIONS[name].command
        command = load_command(command_name)
        parse = functools.partial(parse_options, command_name, command)
        if hasattr(command, "collect_local"):
            requests = command.action_requests() if hasattr(command, "action_requests") else {}
            decode, collect_request = requests.get(name, (None, None))
            table[name] = ActionCommand(
                parse, command.collect_local, command.collect_nodes, decode=decode, collect_request=collect_request
            )
        else:
            table[name] = ActionCommand(parse, command.collect)
    return table


def answer(name: str, argv: list[str], job_wide: bool) -> dict[str, Any]:
    """Run one action's command; its Result (or the error it stopped on) as the child's answer."""
    try:
        command = action_commands([name])[name]
        args = command.parse(argv[1:])
        if job_wide:
            if command.collect_nodes is None:
                raise errors.UsageError(f"{name} runs on this node only")
            nodes: list[Node] = parse_hosts(getattr(args, "hosts", None) or "")
            result: Result = command.collect_nodes(args, nodes)
        else:
            result = command.collect_local(args)
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
        doc = answer(request["action"], request["argv"], request["job_wide"])
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
    argv = doc.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv is not a list of strings")
    if argv[0] != ACTIONS[doc["action"]].command:
        raise ValueError("argv is not the action's command")
    return {"action": doc["action"], "argv": argv, "job_wide": doc.get("job_wide") is True}


if __name__ == "__main__":
    sys.exit(main())
