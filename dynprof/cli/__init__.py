"""The ``dynprof`` command line.

One module per subcommand, each with a class following :class:`Command`: its docstring is the
help text and ``prepare_parser`` adds its arguments. A command that answers a question has
``collect(args) -> Result`` (the answer, as ``--json`` prints it) and ``render(result) -> str``
(the text a person reads); the sidecar's actions and the job-wide layer call ``collect`` too.
A command that runs something until it ends (``run``, ``serve``) has ``run(args) -> int``. Only
:class:`~dynprof.errors.DynprofError` is caught here; anything else is a bug and shows its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Protocol

from dynprof import __version__
from dynprof.errors import DynprofError
from dynprof.kinds import commands
from dynprof.output import print_json, printable_lines, silence_stdout
from dynprof.result import Result
from dynprof.safetext import valid_text

# (subcommand name, module under dynprof.cli, class name), in the order `--help` lists them: the
# rows of dynprof.kinds that have a command.
COMMANDS: tuple[tuple[str, str, str], ...] = commands()


class Command(Protocol):
    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...


class CollectingCommand(Command, Protocol):
    def collect(self, args: argparse.Namespace) -> Result: ...

    def render(self, result: Result) -> str: ...


def emit(command: CollectingCommand, result: Result, as_json: bool) -> int:
    """Show a command's result: its messages on stderr, then its JSON or its text on stdout."""
    for line in result.messages:
        print(f"dynprof: {printable_lines(line)}", file=sys.stderr)
    if as_json:
        print_json(result.to_json())
    else:
        text = command.render(result)
        if text:
            print(text)
    return result.exit_code


def run_command(command: Command, args: argparse.Namespace) -> int:
    if hasattr(command, "collect"):
        return emit(command, command.collect(args), bool(getattr(args, "json", False)))  # type: ignore[arg-type]
    return int(command.run(args))  # type: ignore[attr-defined]


def _load_command(module_name: str, class_name: str) -> Command | None:
    try:
        module = importlib.import_module(f"dynprof.cli.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"dynprof.cli.{module_name}":
            return None  # a subcommand this build does not ship
        raise
    command: Command = getattr(module, class_name)()
    return command


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only``, other subcommands' modules are not imported (fast start)."""
    parser = argparse.ArgumentParser(
        prog="dynprof",
        description="Non-intrusive runtime profiler and diagnostics for PyTorch training jobs.",
        epilog="Exit codes: 0 ok, 1 error, 2 usage, 3 no such process, 4 permission denied, "
        "5 no agent, 6 busy, 7 unsupported in the target, 8 agent error, 9 timed out, 10 not a Python process, "
        "11 ptrace refused and no agent to fall back on, 12 with --hosts: some node did not answer; a closed output pipe (`| head`) ends a command quietly "
        "(with its own code once it has one, else 0). "
        "`dynprof healthcheck` has its own: 0 healthy, 1 warning, 2 unhealthy, 3 could not run.",
    )
    parser.add_argument("--version", action="version", version=f"dynprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name, class_name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        command = _load_command(module_name, class_name)
        if command is None:
            continue
        doc = (type(command).__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else ""
        p = sub.add_parser(
            name,
            help=summary,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.prepare_parser(p)
        p.set_defaults(_command=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {name for name, _, _ in COMMANDS}
    only = argv[0] if argv and argv[0] in names else None
    parser = build_parser(only)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # `dynprof healthcheck` gates jobs on its exit code, where 2 means "unhealthy, drain":
        # a usage error there must read as "could not run" (3), never as a verdict.
        if only == "healthcheck" and exc.code == 2:
            return 3
        raise
    if isinstance(getattr(args, "job", None), str):
        # A job id given in bytes that are not UTF-8 is the id the agents recorded from the
        # same bytes (each as \xNN): both spellings select the job.
        args.job = valid_text(args.job)
    code: int | None = None
    try:
        code = run_command(args._command, args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except DynprofError as exc:
        report_error(exc, as_json=bool(getattr(args, "json", False)))
        return exc.exit_code
    except KeyboardInterrupt:
        print("dynprof: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`dynprof ls | head -1`): it has what it wanted. End quietly, with
        # the command's own code when it had one. A healthcheck cut short never reads "healthy".
        silence_stdout()
        if code is not None:
            return code
        return 3 if only == "healthcheck" else 0


def report_error(exc: DynprofError, as_json: bool = False) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "error": {
                        "type": type(exc).__name__,
                        "message": exc.message,
                        "help": exc.help,
                        "exit_code": exc.exit_code,
                    }
                },
                indent=2,
            )
        )
    # Messages may quote what a target, a file or an argument said: escape it for the terminal.
    print(f"dynprof: error: {printable_lines(exc.message)}", file=sys.stderr)
    if exc.help:
        print(f"  what to do: {printable_lines(exc.help)}", file=sys.stderr)
