"""``dynprof healthcheck``: is this node fit to run a job? And, job-wide, every node of it?

On this node: the checks of :mod:`healthcheck.cli`. Given nodes (``--hosts``, ``--hostfile``,
``--slurm``), every node's sidecar runs its own healthcheck (the ``healthcheck`` action), all at
once; with ``--srun``, ``srun`` starts one healthcheck per node of this allocation instead, no
sidecar needed. Either way the nodes' reports are judged together by :mod:`healthcheck.fleet`
(one table, peers across nodes, the nodes to drain; docs/preflight.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynprof import errors
from dynprof.cli._common import Progress
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.errors import DynprofError
from dynprof.procs import stop_group
from dynprof.result import Result
from healthcheck import cli, fleet
from healthcheck.baseline import learn, read_results
from healthcheck.collect import HealthcheckRequest
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
    cli.DESCRIPTION
    + """
Job-wide (--hosts, --hostfile, --slurm: through each node's `dynprof serve`; --srun: one
healthcheck per node of this Slurm allocation, no sidecar): every node is checked at once and
the reports are judged together: a node whose functional figures are more than --peer-threshold
below the fleet's median fails (peer-slow), and nodes that did not answer or did not finish are
named, never counted healthy. --drain-command prints the scheduler's drain lines. The same exit
codes, job-wide: 2 some node unhealthy, 3 some node could not be checked. See docs/preflight.md.
"""
)

# How long each node's healthcheck may take job-wide, by level (times --timeout-scale), unless
# --timeout says; the sidecar's healthcheck action allows at most 900 s.
NODE_WAIT_S = {"quick": 120.0, "standard": 600.0, "full": 900.0}
MAX_NODE_WAIT_S = 900.0
SIDECAR_GRACE_S = 15.0  # a sidecar answers "timed out" up to 10 s after the action's limit
DRAIN_KINDS = fleet.DRAIN_KINDS
REFUSED_STATUSES = frozenset({400, 401, 403, 413, 429})
# What srun's tasks may print: a node's report is tens of kilobytes.
MAX_TASK_OUTPUT_BYTES = 4 * 1024 * 1024
# A node's report is a few hundred to a few thousand lines (indented JSON): a task's lines are
# bounded too, so short lines (``0: x``) cannot make millions of lines of 4 MiB.
MAX_TASK_OUTPUT_LINES = 50_000
MAX_SRUN_OUTPUT_BYTES = 512 * 1024 * 1024
# Lines that name no task of the allocation (no label, or another task's number): srun with
# --label prints none; past this many, srun is stopped.
MAX_UNLABELLED_LINES = 10_000
MAX_TASK_VALUES = 200_000
SRUN_START_S = 60.0  # srun's own start on top of each node's wait
SRUN_END_GRACE_S = 10.0  # srun's own end, once every task has answered
SRUN_STOP_GRACE_S = 10.0  # srun's end once sent SIGTERM (it stops its tasks), and again after SIGKILL


def _fraction(text: str) -> float:
    from dynprof.arguments import parse_float

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
        default=64 << 20,
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
        default=60.0,
        metavar="SEC",
        help="with --links: seconds one round of pair tests may take; a pair still running then is hung (default 60)",
    )
    group.add_argument(
        "--link-backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="with --links: torch.distributed backend of the pair tests (default auto: NCCL where the node "
        "has a GPU, else gloo)",
    )
    group.add_argument(
        "--link-port",
        type=int,
        default=29720,
        metavar="PORT",
        help="with --links: first TCP port of the pair tests' rendezvous, on the nodes (default 29720)",
    )
    group.add_argument(
        "--drain-command",
        choices=DRAIN_KINDS,
        help="job-wide: print (never run) the lines that drain the nodes to drain: `scontrol update ... "
        "State=DRAIN` (slurm) or `kubectl cordon` and `kubectl taint` (k8s), instead of the table",
    )


def _size(text: str) -> int:
    from dynprof.units import parse_size

    try:
        size = parse_size(text)
    except errors.ArtifactError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if not 1 <= size <= 8 << 30:
        raise argparse.ArgumentTypeError("a size from 1 byte to 8G")
    return size


def _seconds(text: str) -> float:
    from dynprof.arguments import parse_float

    return parse_float(text, 0.0, 86400.0, low_open=True, what="seconds (0 < SEC <= 86400)")


class HealthcheckCommand:
    __doc__ = DESCRIPTION

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        cli.usage_errors_exit_3(parser)
        cli.prepare_parser(parser)
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
                return collect_srun(args)
            if nodes is not None:
                return collect_nodes(args, nodes)
            _refuse_fleet_only(args)
            return _check(args)
        except DynprofError as exc:
            # Every healthcheck failure to run is exit 3, whatever the error's own code:
            # schedulers read 1 and 2 as the node's health.
            exc.exit_code = EXIT_COULD_NOT_RUN
            raise

    def action_requests(self) -> dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[[Any], Result]]]:
        """The sidecar's ``healthcheck`` action read as the kind's request."""
        return {"healthcheck": (decode_request, collect_request)}

    def render(self, result: Result) -> str:
        if isinstance(result, FleetResult):
            if result.drain_kind:
                return "\n".join(fleet.drain_commands(result.report, result.drain_kind))
            return fleet.render_table(result.report, failures_only=result.failures_only)
        if isinstance(result, LearnedBaseline):
            return "" if result.output else json.dumps(result.doc, indent=2)
        assert isinstance(result, HealthReport)
        text = render_table(result.report, show_passed=not result.failures_only)
        return text + (f"\nsaved: {result.artifact}" if result.artifact else "")


def _check(args: argparse.Namespace) -> HealthReport:
    report, artifact, messages = cli.check(args)
    return HealthReport(report, artifact, args.failures_only, messages)


def decode_request(options: dict[str, Any]) -> HealthcheckRequest:
    """The sidecar's ``healthcheck`` action read as the kind's request; a value it refuses is
    the healthcheck's usage error (exit 3: 1 and 2 are the node's health)."""
    try:
        return HealthcheckRequest.from_json(options)
    except DynprofError as exc:
        error = errors.UsageError(f"healthcheck: {exc.message}", help="See `dynprof healthcheck --help`.")
        error.exit_code = EXIT_COULD_NOT_RUN
        raise error from None


def collect_request(request: HealthcheckRequest) -> HealthReport:
    """This node's checks for ``request``, saved as an artifact unless it says not to."""
    try:
        report, artifact, messages = cli.check_request(request)
    except DynprofError as exc:
        exc.exit_code = EXIT_COULD_NOT_RUN
        raise
    return HealthReport(report, artifact, False, messages)


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


def node_wait(args: argparse.Namespace, cap: float | None = MAX_NODE_WAIT_S) -> float:
    wait = args.timeout if args.timeout else NODE_WAIT_S.get(args.level, MAX_NODE_WAIT_S) * args.timeout_scale
    return float(min(wait, cap) if cap is not None else wait)


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


# Options the healthcheck action takes since the job-wide healthcheck: sent only when they are
# not at their defaults, so that the sidecars of older releases still answer.
NEWER_ACTION_OPTIONS = ("fail_below", "warn_below", "peer_fail", "peer_warn", "min_disk_gib", "xid_window")


def _at_default(args: argparse.Namespace) -> dict[str, None]:
    parser = argparse.ArgumentParser(add_help=False)
    cli.prepare_parser(parser)
    defaults = parser.parse_args([])
    return {k: None for k in NEWER_ACTION_OPTIONS if getattr(args, k) == getattr(defaults, k)}


def collect_nodes(args: argparse.Namespace, nodes: list[Any]) -> FleetResult:
    """Every node's sidecar runs its healthcheck at once; their reports are judged together."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from dynprof.cli.job import client_for, forward_options
    from dynprof.job.answers import node_labels

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
    started = time.monotonic()
    wait = node_wait(args)
    client = client_for(args)
    client.timeout = args.node_timeout + SIDECAR_GRACE_S
    options = forward_options("healthcheck", args, skip=sorted(args.skip) or None, **_at_default(args))
    labels = node_labels(nodes)
    progress = Progress(enabled=not args.quiet)
    answers: dict[Any, Any] = {}
    progress.update(f"healthcheck: 0/{len(nodes)} nodes answered")
    with ThreadPoolExecutor(max_workers=min(client.max_in_flight, len(nodes))) as pool:
        futures = {pool.submit(client.action, n, "healthcheck", options, wait): n for n in nodes}
        for future in as_completed(futures):
            answers[futures[future]] = future.result()
            progress.update(f"healthcheck: {len(answers)}/{len(nodes)} nodes answered")
    progress.done()
    outcomes = []
    for n in nodes:
        a = answers[n]
        failure = a.failure
        outcomes.append(
            fleet.NodeOutcome(
                label=labels[n],
                name=n.host,
                answered=a.answered,
                report=a.result if failure is None else None,
                exit_code=a.exit_code,
                error=a.error or (failure.message if failure else None),
                error_type=failure.type if failure else None,
                elapsed_s=a.elapsed_s,
                refused=not a.answered and a.status in REFUSED_STATUSES,
            )
        )
    report = fleet.judge(outcomes, args.peer_threshold, args.level, time.monotonic() - started, how="sidecars")
    if args.links:
        _test_links(
            args, client, [n for n, o in zip(nodes, outcomes, strict=True) if o.answered], nodes, report, progress
        )
        report.duration_s = time.monotonic() - started
    return FleetResult(report, args.drain_command, args.failures_only, _summary_messages(report, args.drain_command))


def _test_links(
    args: argparse.Namespace, client: Any, answered: list[Any], nodes: list[Any], report: Any, progress: Progress
) -> None:
    """The link tests between the nodes that answered, joined to their verdicts."""
    from healthcheck.links.rounds import run_link_rounds
    from healthcheck.links.scheme import DEFAULT_THRESHOLD

    def say(line: str) -> None:
        progress.update(f"links: {line}")

    links = run_link_rounds(
        answered,
        client,
        backend=args.link_backend,
        size_bytes=args.link_size,
        round_limit_s=args.link_limit,
        threshold=args.link_threshold if args.link_threshold is not None else DEFAULT_THRESHOLD,
        store_port=args.link_port,
        progress=say,
    )
    progress.done()
    index = {n.address: i for i, n in enumerate(nodes)}
    fleet.add_link_findings(report, [(index.get(f.node, -1), f) for f in links.findings], links.to_json())


# -- srun ---------------------------------------------------------------------------------------------
_LABEL = re.compile(rb"[ \t]*([0-9]{1,7}): ?")
_READ_CHUNK = 1 << 20  # srun's output is read a MiB at a time and split into lines at once


def srun_command(args: argparse.Namespace, count: int) -> list[str]:
    """``srun`` with one task per node of the allocation, each running ``python -m healthcheck --json``
    with this command's node options."""
    python = args.srun_python or sys.executable
    argv = [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        "--label",
        "--kill-on-bad-exit=0",
        *args.srun_arg,
        python,
        "-m",
        "healthcheck",
        "--json",
        "--quiet",
        f"--level={args.level}",
        f"--backend={args.backend}",
        f"--fail-below={args.fail_below!r}",
        f"--warn-below={args.warn_below!r}",
        f"--peer-fail={args.peer_fail!r}",
        f"--peer-warn={args.peer_warn!r}",
        f"--min-disk-gib={args.min_disk_gib!r}",
        f"--xid-window={args.xid_window!r}",
        f"--timeout-scale={args.timeout_scale!r}",
    ]
    if args.smi_tool:
        argv.append(f"--smi-tool={args.smi_tool}")
    if args.expect_devices is not None:
        argv.append(f"--expect-devices={args.expect_devices}")
    argv += [f"--baseline={b}" for b in args.baseline]
    argv += [f"--disk={d}" for d in args.disk or []]
    if args.skip:
        argv.append(f"--skip={','.join(sorted(args.skip))}")
    if args.prometheus:
        argv.append(f"--prometheus={args.prometheus}")
    if args.no_save:
        argv.append("--no-save")
    return argv


class TaskOutput:
    """Each srun task's lines (``--label``: ``T: text``), bounded per task and in all."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.lines: dict[int, list[str]] = {}
        self.sizes: dict[int, int] = {}
        self.over: set[int] = set()
        self.over_lines: set[int] = set()  # the tasks of ``over`` cut by their lines, not bytes
        self.line_counts: dict[int, int] = {}
        self.finished: set[int] = set()
        self.total = 0
        self.unlabelled = 0
        self.lock = threading.Lock()

    def add(self, line: str) -> None:
        self.add_lines([line.rstrip("\n").encode("utf-8", "surrogateescape")])

    def add_lines(self, lines: list[bytes]) -> None:
        """Lines of srun's output (without their newline), at once: a task over its bound costs
        a label match per line, nothing more (its text is neither decoded nor kept)."""
        with self.lock:
            for raw in lines:
                match = _LABEL.match(raw)
                task = int(match.group(1)) if match else -1
                if match is None or not 0 <= task < self.count:
                    self.unlabelled += 1
                    continue
                if task in self.over:
                    continue
                n = len(raw) - match.end() + 1
                size = self.sizes.get(task, 0) + n
                self.sizes[task] = size
                count = self.line_counts.get(task, 0) + 1
                self.line_counts[task] = count
                if size > MAX_TASK_OUTPUT_BYTES or self.total + n > MAX_SRUN_OUTPUT_BYTES:
                    self.over.add(task)
                    self.lines.pop(task, None)
                    continue
                if count > MAX_TASK_OUTPUT_LINES:
                    self.over.add(task)
                    self.over_lines.add(task)
                    self.lines.pop(task, None)
                    continue
                text = raw[match.end() :].rstrip(b"\r").decode("utf-8", "replace")
                self.total += n
                self.lines.setdefault(task, []).append(text)
                if text == "}":
                    self.finished.add(task)

    def decided(self) -> bool:
        """Every task has answered (its report's last line) or printed past its bound: nothing
        more srun prints can change an outcome."""
        with self.lock:
            return len(self.finished | self.over) >= self.count

    def flooded(self) -> bool:
        with self.lock:
            return bool(self.over)

    def noisy(self) -> bool:
        """srun printed more lines that name no task than it ever should: it is stopped."""
        with self.lock:
            return self.unlabelled > MAX_UNLABELLED_LINES

    def outcome(self, task: int, name: str, timed_out: bool, stopped: bool = False) -> fleet.NodeOutcome:
        """Task ``task``'s report, or why there is none; ``timed_out``: srun ran past its time
        limit, ``stopped``: srun was stopped for its output before every task had answered."""
        from dynprof.untrusted import loads_json

        label = name
        if task in self.over_lines:
            why = f"its task printed over {MAX_TASK_OUTPUT_LINES} lines: refused"
            return fleet.NodeOutcome(label, name, False, error=why)
        if task in self.over:
            why = f"its task printed over {MAX_TASK_OUTPUT_BYTES >> 20} MiB: refused"
            return fleet.NodeOutcome(label, name, False, error=why)
        text = "\n".join(self.lines.get(task, []))
        if not text.strip() or (stopped and task not in self.finished):
            if timed_out:
                why = "srun ran past the time limit before its task answered"
            elif stopped:
                why = "srun was stopped before its task answered"
            else:
                why = "its task printed nothing"
            return fleet.NodeOutcome(label, name, False, error=why)
        try:
            doc = loads_json(text, f"the output of srun task {task}", max_values=MAX_TASK_VALUES)
        except DynprofError as exc:
            return fleet.NodeOutcome(label, name, False, error=f"its task printed no JSON report ({exc.message})")
        code = doc.get("exit_code") if isinstance(doc, dict) else None
        return fleet.NodeOutcome(label, name, True, report=doc, exit_code=code if isinstance(code, int) else None)


def _pump(stream: Any, sink: TaskOutput, progress: Progress) -> None:
    """srun's output, a MiB at a time, split into lines (a line longer than a task may print
    counts against its task as it is)."""
    fd = stream.fileno()
    pending = b""
    answered = -1
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except OSError:
            break
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        if len(pending) > MAX_TASK_OUTPUT_BYTES:
            lines.append(pending)
            pending = b""
        sink.add_lines(lines)
        if len(sink.finished) != answered:
            answered = len(sink.finished)
            progress.update(f"healthcheck: {answered}/{sink.count} nodes answered")
    if pending:
        sink.add_lines([pending])


def collect_srun(args: argparse.Namespace) -> FleetResult:
    """One ``python -m healthcheck --json`` per node of this allocation, through ``srun``; each
    task's report read back bounded and judged with the others. Task T is the T-th node of the
    allocation's node list (one task per node, in order)."""
    from dynprof.job.discovery import slurm_hosts

    if shutil.which("srun") is None:
        raise errors.UsageError(
            "--srun needs srun on PATH", help="Run it on a node of the Slurm cluster, inside the allocation."
        )
    if not (os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")):
        raise errors.UsageError(
            "--srun checks the nodes of this Slurm allocation, and there is none here (SLURM_JOB_NODELIST is not set)",
            help="Run it inside the allocation (salloc, sbatch), or ask the nodes' sidecars with --slurm JOB.",
        )
    hosts = slurm_hosts()
    started = time.monotonic()
    wait = node_wait(args, cap=None) + SRUN_START_S
    argv = srun_command(args, len(hosts))
    sink = TaskOutput(len(hosts))
    progress = Progress(enabled=not args.quiet)
    env = dict(os.environ)
    env.pop("DYNPROF", None)  # the healthchecks are tools, not jobs
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise errors.UsageError(f"cannot start srun: {exc.strerror or exc}") from None
    stderr_tail: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in iter(lambda: proc.stderr.readline(8192), b""):  # type: ignore[union-attr]
            stderr_tail.append(line.decode("utf-8", "replace").rstrip("\n")[:500])
            del stderr_tail[:-20]

    readers = [
        threading.Thread(target=_pump, args=(proc.stdout, sink, progress), daemon=True),
        threading.Thread(target=read_stderr, daemon=True),
    ]
    for r in readers:
        r.start()
    timed_out = stopped = noisy = False
    deadline = time.monotonic() + wait
    try:
        # srun is stopped once every task has answered or printed past its bound (a task that
        # prints on and on does not hold the others until srun's deadline); where none printed
        # past its bound, srun has SRUN_END_GRACE_S to end on its own first.
        decided_at: float | None = None
        while True:
            try:
                proc.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if sink.noisy():
                    noisy = True
                    stop_group(proc, SRUN_STOP_GRACE_S)
                    break
                if decided_at is None and sink.decided():
                    decided_at = time.monotonic()
                if decided_at is not None and (sink.flooded() or time.monotonic() - decided_at > SRUN_END_GRACE_S):
                    stopped = True
                    stop_group(proc, SRUN_STOP_GRACE_S)
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    stop_group(proc, SRUN_STOP_GRACE_S)
                    break
    finally:
        if proc.poll() is None:
            stop_group(proc, SRUN_STOP_GRACE_S)
    for r in readers:
        r.join(10)
    progress.done()
    outcomes = [sink.outcome(t, host, timed_out, stopped=noisy) for t, host in enumerate(hosts)]
    report = fleet.judge(outcomes, args.peer_threshold, args.level, time.monotonic() - started, how="srun")
    messages = _summary_messages(report, args.drain_command)
    if timed_out:
        messages.insert(0, f"healthcheck: srun ran past {wait:g} s and was stopped")
    elif noisy:
        messages.insert(
            0,
            f"healthcheck: srun printed over {MAX_UNLABELLED_LINES} lines that name no task of this allocation "
            "(is --label among its arguments?): srun was stopped; the nodes that had not answered are named",
        )
    elif stopped:
        over = ", ".join(hosts[t] for t in sorted(sink.over)) or "none"
        messages.insert(0, f"healthcheck: every task answered or printed past its bound ({over}): srun was stopped")
    elif proc.returncode not in (0, 1, 2, 3) and stderr_tail:
        messages.insert(0, f"healthcheck: srun exited {proc.returncode}: {stderr_tail[-1]}")
    return FleetResult(report, args.drain_command, args.failures_only, messages)
