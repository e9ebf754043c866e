"""An action's options as its CLI command's flags, read by that command's own parser.

The sidecar never builds an argument list (every action carries its kind's request). These
tests hold the two faces to one another: each option an action takes is a flag of its command,
and the request read from the options is the request the command makes of the same flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from dynprof import errors
from dynprof.sidecar.actions import check_options
from dynprof.sidecar.table import ACTIONS, Option


def load_command(name: str) -> Any:
    """The command object of subcommand ``name`` (as ``dynprof NAME`` builds it)."""
    import importlib

    from dynprof.cli import COMMANDS

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


def parse_options(
    action: str, command: Any, options: dict[str, Any], hosts: Sequence[str] | None, cacert: str | None
) -> argparse.Namespace:
    """Action ``action``'s checked ``options`` (job-wide: its ``hosts``, and the CA file to
    trust) read by its command's own parser, each option as its flag; a refused value is a usage
    error with the command's own usage exit code (2; healthcheck's 3), and nothing is printed."""
    spec = ACTIONS[action]
    name = spec.command
    parser = command_parser(name, command)

    def refuse(status: int = 0, message: str | None = None) -> NoReturn:
        raise _Refused(status, (message or "").strip())

    # argparse's error() prints the usage, then exits with the parser's usage code (the
    # command may have its own, as healthcheck does): neither happens here.
    parser.print_usage = lambda file=None: None  # type: ignore[method-assign]
    parser.exit = refuse  # type: ignore[method-assign]
    try:
        return parser.parse_args(flags(action, options, hosts, cacert))
    except _Refused as exc:
        message = exc.message.removeprefix(f"{parser.prog}: error: ")
        error = errors.UsageError(f"{name}: {message}", help=f"See `dynprof {name} --help`.")
        error.exit_code = exc.status or 2
        raise error from None


def read_options(action: str, command: Any, options: dict[str, Any]) -> argparse.Namespace:
    """Action ``action``'s ``options``, checked as the sidecar checks them, read by its command's
    own parser on this node (no hosts): what the command makes of the flags the CLI maps them to."""
    return parse_options(action, command, check_options(action, options).options, None, None)


def flags(action: str, options: dict[str, Any], hosts: Sequence[str] | None, cacert: str | None) -> list[str]:
    """The command's arguments (without its name) for action ``action``'s options: each one
    ``--flag=value``, a single argument, so a value is never read as another flag."""
    spec = ACTIONS[action]
    out = list(spec.leading)
    if hosts is not None:
        out.append(f"--hosts={','.join(hosts)}")
        if cacert:
            out.append(f"--cacert={cacert}")
    for key, value in options.items():
        opt = spec.options.get(key) or Option("--" + key.replace("_", "-"), "str")
        if value is None or value is False:
            continue
        if value is True:
            out.append(opt.flag)
        elif isinstance(value, list):
            out.append(f"{opt.flag}={','.join(str(v) for v in value)}")
        elif isinstance(value, float):
            out.append(f"{opt.flag}={value!r}")
        else:
            out.append(f"{opt.flag}={value}")
    out.append("--json")
    return out
