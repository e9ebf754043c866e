"""``dynprof healthcheck``: is this node fit to run a job? And, job-wide, every node of it?

On this node: the checks of the request its options make (:mod:`healthcheck.arguments`, the
kind's one option table), run by :func:`healthcheck.collect.collect_here`. Given nodes
(``--hosts``, ``--hostfile``, ``--slurm``), every node's sidecar runs its own healthcheck, all at
once; with ``--srun``, ``srun`` starts one healthcheck per node of this allocation instead, no
sidecar needed (:mod:`dynprof.job.healthcheck`). Either way the nodes' reports are judged
together by :mod:`healthcheck.fleet` (one table, peers across nodes, the nodes to drain;
docs/preflight.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dynprof import errors
from dynprof.arguments import parse_float
from dynprof.cli._common import Progress
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.cli.job import client_for
from dynprof.errors import DynprofError
from dynprof.job.healthcheck import JobWide, Links, collect_nodes, collect_srun
from dynprof.result import Result
from dynprof.units import parse_size
from healthcheck import fleet
from healthcheck.arguments import DESCRIPTION as NODE_DESCRIPTION
from healthcheck.arguments import add_check_arguments, request_from_args, usage_errors_exit_3
from healthcheck.baseline import learn_files
from healthcheck.collect import Checked, collect_here
from healthcheck.fleet_text import render_fleet
from healthcheck.report import Report, render_table
from healthcheck.result import EXIT_COULD_NOT_RUN


class HealthReport(Result):
    """A node's report: ``--json`` prints the report with the artifact it was saved as."""

    def __init__(self, checked: Checked, failures_only: bool) -> None:
        super().__init__({}, checked.report.exit_code, checked.messages)
        self.checked = checked
        self.failures_only = failures_only

    @property
    def report(self) -> Report:
        return self.checked.report

    @property
    def artifact(self) -> str | None:
        return self.checked.artifact

    def to_json(self) -> dict[str, Any]:
        return self.checked.to_json()


class LearnedBaseline(Result):
    """``healthcheck baseline learn``: the baseline, or where it was written (``output``)."""

    def __init__(self, baseline: dict[str, Any], output: str | None, messages: list[str]) -> None:
        super().__init__(baseline, 0, messages)
        self.output = output


class FleetResult(Result):
    """The job-wide report: ``--json`` prints the fleet document (schema ``dynprof.healthcheck.fleet``)."""

    def __init__(self, report: fleet.FleetReport, drain_kind: str | None, failures_only: bool, messages: list[str]):
        super().__init__({}, report.exit_code, messages)
        self.report = report
        self.drain_kind = drain_kind
        self.failures_only = failures_only

    def to_json(self) -> dict[str, Any]:
        return self.report.to_json(self.drain_kind)


DESCRIPTION = (
    NODE_DESCRIPTION
    + """
Job-wide (--hosts, --hostfile, --slurm: through each node's `dynprof serve`; --srun: one
healthcheck per node of this Slurm allocation, no sidecar): every node is checked at once and
the reports are judged together: a node whose functional figures are more than --peer-threshold
below the fleet's median fails (peer-slow), and nodes that did not answer or did not finish are
named, never counted healthy. --drain-command prints the scheduler's drain lines. The same exit
codes, job-wide: 2 some node unhealthy, 3 some node could not be checked. See docs/preflight.md.
"""
)


def _fraction(text: str) -> float:
    return parse_float(text, 0.0, 1.0, low_open=True, what="a fraction between 0 and 1")


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    add_many_node_args(parser)
    group = parser.add_argument_group("job-wide preflight (see docs/preflight.md)")
    group.add_argument(
        "--srun",
        action="store_true",
        help="run one healthcheck per node of this Slurm allocation through srun (no sidecars), and judge "
        "them together",
    )
    group.add_argument(
        "--srun-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --srun: one more argument for srun (repeat it: --srun-arg=--overlap --srun-arg=--jobid=123)",
    )
    group.add_argument(
        "--srun-python",
        metavar="PATH",
        help="with --srun: the Python that runs `-m healthcheck` on every node (default: this one, at the same path)",
    )
    group.add_argument(
        "--timeout",
        type=_seconds,
        metavar="SEC",
        help="job-wide: seconds each node's healthcheck may take (default by level: quick 120, standard 600, "
        "full 900, times --timeout-scale; at most 900 through the sidecars)",
    )
    group.add_argument(
        "--peer-threshold",
        type=_fraction,
        default=fleet.DEFAULT_PEER_THRESHOLD,
        metavar="F",
        help=f"job-wide: a functional figure more than F below the fleet's median fails its node (peer-slow; "
        f"default {fleet.DEFAULT_PEER_THRESHOLD:g}; compared only over {fleet.MIN_PEER_NODES} nodes or more)",
    )
    group.add_argument(
        "--links",
        action="store_true",
        help="job-wide, through the sidecars: after the node checks, test the links between the nodes that "
        "answered, pair by pair in rounds, and name the slow node (see docs/links.md)",
    )
    group.add_argument(
        "--link-size",
        type=_size,
        default=Links.size_bytes,
        metavar="SIZE",
        help="with --links: the buffer each pair exchanges (default 64M)",
    )
    group.add_argument(
        "--link-threshold",
        type=_fraction,
        metavar="F",
        help="with --links: a pair more than F below the median of the other pairs is slow (default 0.1)",
    )
    group.add_argument(
        "--link-limit",
        type=_seconds,
        default=Links.limit_s,
        metavar="SEC",
        help="with --links: seconds one round of pair tests may take; a pair still running then is hung (default 60)",
    )
    group.add_argument(
        "--link-backend",
        choices=("auto", "gloo", "nccl"),
        default=Links.backend,
        help="with --links: torch.distributed backend of the pair tests (default auto: NCCL where the node "
        "has a GPU, else gloo)",
    )
    group.add_argument(
        "--link-port",
        type=int,
        default=Links.port,
        metavar="PORT",
        help="with --links: first TCP port of the pair tests' rendezvous, on the nodes (default 29720)",
    )
    group.add_argument(
        "--drain-command",
        choices=fleet.DRAIN_KINDS,
        help="job-wide: print (never run) the lines that drain the nodes to drain: `scontrol update ... "
        "State=DRAIN` (slurm) or `kubectl cordon` and `kubectl taint` (k8s), instead of the table",
    )


def _size(text: str) -> int:
    try:
        size = parse_size(text)
    except errors.ArtifactError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if not 1 <= size <= 8 << 30:
        raise argparse.ArgumentTypeError("a size from 1 byte to 8G")
    return size


def _seconds(text: str) -> float:
    return parse_float(text, 0.0, 86400.0, low_open=True, what="seconds (0 < SEC <= 86400)")


class HealthcheckCommand:
    __doc__ = DESCRIPTION

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        usage_errors_exit_3(parser)
        add_check_arguments(parser)
        add_fleet_arguments(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        try:
            nodes = nodes_requested(args)
            if getattr(args, "hc_command", None) == "baseline":
                if nodes is not None or args.srun:
                    raise errors.UsageError("`healthcheck baseline learn` reads result files: it takes no nodes")
                return _learn(args)
            if args.srun:
                if nodes is not None:
                    raise errors.UsageError(
                        "--srun starts the healthchecks itself: give it without --hosts/--hostfile/--slurm",
                        help="--srun checks every node of this allocation; --slurm asks their sidecars.",
                    )
                if args.links:
                    raise errors.UsageError(
                        "--links runs through the sidecars: give the nodes with --hosts, --hostfile or --slurm",
                        help="Under srun without sidecars, the link tests are not available yet (docs/links.md).",
                    )
                return _collect_srun(args)
            if nodes is not None:
                return _collect_nodes(args, nodes)
            _refuse_fleet_only(args)
            return _check(args)
        except DynprofError as exc:
            # Every healthcheck failure to run is exit 3, whatever the error's own code:
            # schedulers read 1 and 2 as the node's health.
            exc.exit_code = EXIT_COULD_NOT_RUN
            raise

    def render(self, result: Result) -> str:
        if isinstance(result, FleetResult):
            if result.drain_kind:
                return "\n".join(fleet.drain_commands(result.report, result.drain_kind))
            return render_fleet(result.report, failures_only=result.failures_only)
        if isinstance(result, LearnedBaseline):
            return "" if result.output else json.dumps(result.doc, indent=2)
        assert isinstance(result, HealthReport)
        text = render_table(result.report, show_passed=not result.failures_only)
        return text + (f"\nsaved: {result.artifact}" if result.artifact else "")


def _check(args: argparse.Namespace) -> HealthReport:
    return HealthReport(collect_here(request_from_args(args), show_progress=not args.quiet), args.failures_only)


def _learn(args: argparse.Namespace) -> LearnedBaseline:
    baseline, written = learn_files(args.results, args.source, args.output)
    return LearnedBaseline(baseline, args.output if written else None, [written] if written else [])


# -- job-wide -------------------------------------------------------------------------------------
def _refuse_fleet_only(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (
            ("--drain-command", args.drain_command),
            ("--timeout", args.timeout),
            ("--srun-arg", args.srun_arg),
            ("--srun-python", args.srun_python),
            ("--peer-threshold", args.peer_threshold != fleet.DEFAULT_PEER_THRESHOLD),
            ("--links", args.links),
        )
        if value
    ]
    if given:
        raise errors.UsageError(
            f"{given[0]} is for a job-wide healthcheck: give the nodes (--hosts, --hostfile, --slurm) or --srun",
            help="See docs/preflight.md.",
        )


def job_wide(args: argparse.Namespace) -> JobWide:
    """The job-wide options of ``args``."""
    links = (
        Links(args.link_size, args.link_threshold, args.link_limit, args.link_backend, args.link_port)
        if args.links
        else None
    )
    return JobWide(args.timeout, args.peer_threshold, tuple(args.srun_arg), args.srun_python, links)


def _summary_messages(report: fleet.FleetReport, drain_kind: str | None) -> list[str]:
    out = []
    for v in report.verdicts:
        if v.status == "unknown" and v.reasons:
            out.append(f"healthcheck: node {v.outcome.label}: {v.reasons[0].describe()}")
    if drain_kind:
        counts = report.counts()
        out.append(
            f"healthcheck: verdict {report.verdict} (exit {report.exit_code}): {counts['drain']} of "
            f"{counts['nodes']} node(s) to drain; the lines on stdout are printed, not run"
        )
    return out[:200]


def _collect_nodes(args: argparse.Namespace, nodes: list[Any]) -> FleetResult:
    """Every node's sidecar runs its healthcheck at once; their reports are judged together."""
    local_only = [
        flag
        for flag, value in (
            ("--smi-tool", args.smi_tool),
            ("--baseline", args.baseline),
            ("--disk", args.disk),
            ("--prometheus", args.prometheus),
        )
        if value
    ]
    if local_only:
        raise errors.UsageError(
            f"{local_only[0]} names a file or tool of the node: it does not travel to the sidecars",
            help="Each node's sidecar uses its own; with --srun every node's healthcheck takes it "
            "(the same path on every node).",
        )
    report = collect_nodes(
        request_from_args(args),
        job_wide(args),
        nodes,
        client_for(args),
        args.node_timeout,
        Progress(enabled=not args.quiet),
    )
    return FleetResult(report, args.drain_command, args.failures_only, _summary_messages(report, args.drain_command))


def _collect_srun(args: argparse.Namespace) -> FleetResult:
    """One healthcheck per node of this allocation, through srun, judged together."""
    report, note = collect_srun(request_from_args(args), job_wide(args), Progress(enabled=not args.quiet))
    messages = _summary_messages(report, args.drain_command)
    if note:
        messages.insert(0, note)
    return FleetResult(report, args.drain_command, args.failures_only, messages)
