"""``dynprof healthcheck``: is this node fit to run a job?"""

from __future__ import annotations

import argparse

from dynprof.errors import DynprofError
from healthcheck import cli
from healthcheck.result import EXIT_COULD_NOT_RUN


class HealthcheckCommand:
    __doc__ = cli.DESCRIPTION

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        cli.usage_errors_exit_3(parser)
        cli.prepare_parser(parser)

    def run(self, args: argparse.Namespace) -> int:
        try:
            return cli.run_command(args)
        except DynprofError as exc:
            # Every healthcheck failure to run is exit 3, whatever the error's own code:
            # schedulers read 1 and 2 as the node's health.
            exc.exit_code = EXIT_COULD_NOT_RUN
            raise
