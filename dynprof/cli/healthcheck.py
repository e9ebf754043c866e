"""``dynprof healthcheck``: is this node fit to run a job?"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dynprof.errors import DynprofError
from dynprof.result import Result
from healthcheck import cli
from healthcheck.baseline import learn, read_results
from healthcheck.report import Report, render_table
from healthcheck.result import EXIT_COULD_NOT_RUN


class HealthReport(Result):
    """A node's report: ``--json`` prints the report with the artifact it was saved as."""

    def __init__(self, report: Report, artifact: str | None, failures_only: bool, messages: list[str]) -> None:
        super().__init__({}, report.exit_code, messages)
        self.report = report
        self.artifact = artifact
        self.failures_only = failures_only

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = self.report.to_json()
        data["artifact"] = self.artifact
        return data


class LearnedBaseline(Result):
    """``healthcheck baseline learn``: the baseline, or where it was written (``output``)."""

    def __init__(self, baseline: dict[str, Any], output: str | None, messages: list[str]) -> None:
        super().__init__(baseline, 0, messages)
        self.output = output


class HealthcheckCommand:
    __doc__ = cli.DESCRIPTION

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        cli.usage_errors_exit_3(parser)
        cli.prepare_parser(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        try:
            if getattr(args, "hc_command", None) == "baseline":
                return _learn(args)
            return _check(args)
        except DynprofError as exc:
            # Every healthcheck failure to run is exit 3, whatever the error's own code:
            # schedulers read 1 and 2 as the node's health.
            exc.exit_code = EXIT_COULD_NOT_RUN
            raise

    def render(self, result: Result) -> str:
        if isinstance(result, LearnedBaseline):
            return "" if result.output else json.dumps(result.doc, indent=2)
        assert isinstance(result, HealthReport)
        text = render_table(result.report, show_passed=not result.failures_only)
        return text + (f"\nsaved: {result.artifact}" if result.artifact else "")


def _check(args: argparse.Namespace) -> HealthReport:
    report, artifact, messages = cli.check(args)
    return HealthReport(report, artifact, args.failures_only, messages)


def _learn(args: argparse.Namespace) -> LearnedBaseline:
    results = read_results(args.results)
    baseline = learn(results, source=args.source)
    if not args.output:
        return LearnedBaseline(baseline, None, [])
    try:
        Path(args.output).write_text(json.dumps(baseline, indent=2) + "\n")
    except OSError as exc:
        raise DynprofError(f"cannot write the baseline to {args.output}: {exc.strerror or exc}") from None
    skus = ", ".join(f"{b['sku']['name']} {b['sku']['memory_gib']}GiB" for b in baseline["baselines"])
    return LearnedBaseline(
        baseline, args.output, [f"baseline for {skus} from {len(results)} results written to {args.output}"]
    )
