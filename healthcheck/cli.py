"""``python -m healthcheck``: this node's checks, without the rest of dynprof's command line.

The options are the kind's one table (:mod:`healthcheck.arguments`), the checks run through
:func:`healthcheck.collect.collect_here`, as ``dynprof healthcheck`` runs them on its node.
"""

from __future__ import annotations

import argparse
import json
import sys

from dynprof import jsontext
from dynprof.errors import DynprofError
from dynprof.output import silence_stdout
from healthcheck.arguments import DESCRIPTION, UsageParser, add_check_arguments, request_from_args
from healthcheck.baseline import learn_files
from healthcheck.collect import collect_here
from healthcheck.report import render_table
from healthcheck.result import EXIT_COULD_NOT_RUN


def run_command(args: argparse.Namespace) -> int:
    if getattr(args, "hc_command", None) == "baseline":
        return learn_command(args)
    checked = collect_here(request_from_args(args), show_progress=not args.quiet)
    for line in checked.messages:
        print(f"dynprof {line}", file=sys.stderr)
    if args.json:
        print(jsontext.dumps(checked.to_json(), indent=2, default=str))
    else:
        print(render_table(checked.report, show_passed=not args.failures_only))
        if checked.artifact:
            print(f"saved: {checked.artifact}")
    return checked.report.exit_code


def learn_command(args: argparse.Namespace) -> int:
    baseline, written = learn_files(args.results, args.source, args.output)
    if written:
        print(written, file=sys.stderr)
    else:
        sys.stdout.write(json.dumps(baseline, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(
        prog="python -m healthcheck", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_check_arguments(parser)
    args = parser.parse_args(argv)
    code: int | None = None
    try:
        code = run_command(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): the verdict, if there was one, stands as the exit code;
        # never "healthy" by default.
        silence_stdout()
        return EXIT_COULD_NOT_RUN if code is None else code
    except DynprofError as exc:
        print(f"healthcheck: error: {exc.message}", file=sys.stderr)
        if exc.help:
            print(f"  what to do: {exc.help}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
