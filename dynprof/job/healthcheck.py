"""The job-wide healthcheck: every node checked at once and the reports judged together
(:func:`healthcheck.fleet.judge`: one table, peers across nodes, the nodes to drain;
docs/preflight.md).

* :func:`collect_nodes`: every node's sidecar runs its own healthcheck (the ``healthcheck``
  action, the request's :meth:`~healthcheck.collect.HealthcheckRequest.action_options`), and,
  with :class:`Links`, the link tests between the nodes that answered.
* :func:`collect_srun`: ``srun`` starts one healthcheck per node of this allocation instead, no
  sidecar needed: each task is handed the request as one JSON argument
  (:func:`healthcheck.collect.task_command`) and prints its report; each task's lines are read
  back bounded, and every report decoded by the one reader of a node's report
  (:meth:`healthcheck.fleet.NodeReport.from_json`, in :func:`~healthcheck.fleet.judge`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dynprof import errors
from dynprof.errors import DynprofError
from dynprof.job.answers import node_labels
from dynprof.job.discovery import slurm_hosts
from dynprof.nodes import Node
from dynprof.procs import stop_group
from dynprof.untrusted import loads_json
from healthcheck import fleet
from healthcheck.collect import HealthcheckRequest, task_command
from healthcheck.links.rounds import run_link_rounds
from healthcheck.links.scheme import DEFAULT_THRESHOLD
from healthcheck.tools import start_tool

if TYPE_CHECKING:  # the HTTP client is made by the caller, imported only where nodes are asked
    from dynprof.job.client import SidecarClient

# How long each node's healthcheck may take job-wide, by level (times --timeout-scale), unless
# --timeout says; the sidecar's healthcheck action allows at most 900 s.
NODE_WAIT_S = {"quick": 120.0, "standard": 600.0, "full": 900.0}
MAX_NODE_WAIT_S = 900.0
SIDECAR_GRACE_S = 15.0  # a sidecar answers "timed out" up to 10 s after the action's limit
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


class Progress(Protocol):
    """A one-line progress display (the CLI's, on stderr)."""

    def update(self, text: str) -> None: ...

    def done(self) -> None: ...


@dataclass(frozen=True)
class Links:
    """``--links``: the link tests between the nodes that answered (docs/links.md)."""

    size_bytes: int = 64 << 20
    threshold: float | None = None  # None: the scheme's default
    limit_s: float = 60.0
    backend: str = "auto"
    port: int = 29720


@dataclass(frozen=True)
class JobWide:
    """What a job-wide healthcheck adds to the node's request: each node's wait (``timeout``;
    None: by level), the ``peer_threshold`` of the comparison across nodes, srun's own
    arguments and the Python its tasks run (``--srun``), the link tests (``--links``)."""

    timeout: float | None = None
    peer_threshold: float = fleet.DEFAULT_PEER_THRESHOLD
    srun_args: tuple[str, ...] = ()
    srun_python: str | None = None
    links: Links | None = None


def node_wait(request: HealthcheckRequest, timeout: float | None, cap: float | None = MAX_NODE_WAIT_S) -> float:
    """How long each node's healthcheck may take: ``timeout``, else by level times the request's
    timeout scale; at most ``cap``."""
    wait = timeout if timeout else NODE_WAIT_S.get(request.level, MAX_NODE_WAIT_S) * request.timeout_scale
    return float(min(wait, cap) if cap is not None else wait)


def collect_nodes(
    request: HealthcheckRequest,
    job: JobWide,
    nodes: list[Node],
    client: SidecarClient,
    node_timeout: float,
    progress: Progress,
) -> fleet.FleetReport:
    """Every node's sidecar runs its healthcheck at once; their reports are judged together."""
    started = time.monotonic()
    wait = node_wait(request, job.timeout)
    client.timeout = node_timeout + SIDECAR_GRACE_S
    options = request.action_options()
    labels = node_labels(nodes)
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
    report = fleet.judge(outcomes, job.peer_threshold, request.level, time.monotonic() - started, how="sidecars")
    if job.links is not None:
        answered = [n for n, o in zip(nodes, outcomes, strict=True) if o.answered]
        _test_links(job.links, client, answered, nodes, report, progress)
        report.duration_s = time.monotonic() - started
    return report


def _test_links(
    links: Links, client: SidecarClient, answered: list[Node], nodes: list[Node], report: Any, progress: Progress
) -> None:
    """The link tests between the nodes that answered, joined to their verdicts."""

    def say(line: str) -> None:
        progress.update(f"links: {line}")

    done = run_link_rounds(
        answered,
        client,
        backend=links.backend,
        size_bytes=links.size_bytes,
        round_limit_s=links.limit_s,
        threshold=links.threshold if links.threshold is not None else DEFAULT_THRESHOLD,
        store_port=links.port,
        progress=say,
    )
    progress.done()
    index = {n.address: i for i, n in enumerate(nodes)}
    fleet.add_link_findings(report, [(index.get(f.node, -1), f) for f in done.findings], done.to_json())


# -- srun ---------------------------------------------------------------------------------------------
_LABEL = re.compile(rb"[ \t]*([0-9]{1,7}): ?")
_READ_CHUNK = 1 << 20  # srun's output is read a MiB at a time and split into lines at once


def srun_command(request: HealthcheckRequest, job: JobWide, count: int) -> list[str]:
    """``srun`` with one task per node of the allocation, each running this node's healthcheck
    for ``request`` (handed as one JSON argument) and printing its report."""
    return [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        "--label",
        "--kill-on-bad-exit=0",
        *job.srun_args,
        *task_command(request, job.srun_python or sys.executable),
    ]


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


def collect_srun(request: HealthcheckRequest, job: JobWide, progress: Progress) -> tuple[fleet.FleetReport, str | None]:
    """One healthcheck per node of this allocation, through ``srun``; each task's report read
    back bounded and judged with the others. Task T is the T-th node of the allocation's node
    list (one task per node, in order). Returns the report and, where srun did not end on its
    own, what happened to it."""
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
    wait = node_wait(request, job.timeout, cap=None) + SRUN_START_S
    argv = srun_command(request, job, len(hosts))
    sink = TaskOutput(len(hosts))
    try:
        proc = start_tool(argv)  # the healthchecks are tools, not jobs
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
    report = fleet.judge(outcomes, job.peer_threshold, request.level, time.monotonic() - started, how="srun")
    note: str | None = None
    if timed_out:
        note = f"healthcheck: srun ran past {wait:g} s and was stopped"
    elif noisy:
        note = (
            f"healthcheck: srun printed over {MAX_UNLABELLED_LINES} lines that name no task of this allocation "
            "(is --label among its arguments?): srun was stopped; the nodes that had not answered are named"
        )
    elif stopped:
        over = ", ".join(hosts[t] for t in sorted(sink.over)) or "none"
        note = f"healthcheck: every task answered or printed past its bound ({over}): srun was stopped"
    elif proc.returncode not in (0, 1, 2, 3) and stderr_tail:
        note = f"healthcheck: srun exited {proc.returncode}: {stderr_tail[-1]}"
    return report, note
