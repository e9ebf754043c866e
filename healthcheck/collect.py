"""The healthcheck kind's typed entry point: a :class:`HealthcheckRequest`, and :func:`collect`,
which runs the checks it asks for in a child process and returns the node's report, decoded by
the one reader of a node's report (:meth:`healthcheck.fleet.NodeReport.from_json`).

    >>> report = collect(HealthcheckRequest(level="quick", job="j1"))   # doctest: +SKIP
    >>> report.exit_code, [c.name for c in report.checks if c.status is not Status.PASS]  # doctest: +SKIP

Why a child: NVML and the smi tools can hang in the driver (a child can be killed, a thread
cannot), and the GPU checks must leave no CUDA or NVML state in the process that asks (the watch,
the sidecar hosting it). The child is this module, ``python -m healthcheck.collect OUT``: the
request's JSON on its stdin, the report's JSON written to the file ``OUT`` (nothing a check
prints on stdout can be taken for it). Its stderr's last line says why, when no report came.

Where the checks are what a process is for (``dynprof healthcheck`` and ``python -m healthcheck``
on the node, whose options make the request: :mod:`healthcheck.arguments`; the sidecar's
``healthcheck`` action, itself run in a child; each task of ``dynprof healthcheck --srun``,
``python -m healthcheck.collect --task REQUEST``), :func:`collect_here` runs them in that
process and saves the report as an artifact, unless the request says not to.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dynprof import errors, jsontext
from dynprof.action_spec import ActionSpec
from dynprof.procs import kill_group
from dynprof.registry import list_records
from dynprof.result import Result
from dynprof.store import ArtifactStore
from dynprof.untrusted import loads_json
from healthcheck.checks.table import ALL_CHECKS
from healthcheck.compare import Thresholds
from healthcheck.fleet import NodeReport, ReportError
from healthcheck.options import LEVELS, Options
from healthcheck.report import Report, render_prometheus, render_table, write_atomically
from healthcheck.result import EXIT_COULD_NOT_RUN
from healthcheck.runner import run
from healthcheck.timeouts import PROBE_TIMEOUT_S
from healthcheck.tools import tool_env

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
MAX_JOB_CHARS = 200
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes
MAX_REQUEST_KEYS = 16
MAX_LOCAL_REQUEST_BYTES = 128 * 1024  # with the node's own files and tools (--srun's tasks: one argument)
MAX_PATHS = 256
MAX_PATH_CHARS = 4096
MAX_REPORT_BYTES = 16 << 20  # real reports are a few KiB to a few hundred KiB
MAX_REPORT_VALUES = 1_000_000
STDERR_TAIL_BYTES = 4096
EXIT_NO_REPORT = 3  # the child's exit when it wrote no report (the healthcheck's "could not run")


BACKENDS = ("auto", "nvml", "smi")
MAX_TIMEOUT_SCALE = 100.0
MAX_DISK_GIB = 1_000_000.0
MAX_XID_WINDOW_MIN = 525_600.0  # a year
MAX_DEVICES = 4096
MAX_PROBE_TIMEOUT_S = 600.0
MAX_COUNTER_WINDOW_S = 600.0


@dataclass(frozen=True)
class HealthcheckRequest:
    """What to check on this node: the ``level`` (``quick``: passive, seconds; ``standard``,
    ``full``), the ``job`` whose processes here are its own (not counted as others holding the
    devices), how the devices are read (``backend``) and how many there must be
    (``expect_devices``), the checks to ``skip``, the thresholds of ``dynprof healthcheck`` (same
    names, same defaults), whether to save the report as an artifact (``no_save``), and the
    ``timeout`` past which the child running the checks is killed (:func:`collect`). Checked when
    made, as the command's parser checks its flags: a bad request raises
    :class:`~dynprof.errors.UsageError`.

    ``OPTIONS`` are what the sidecar's ``healthcheck`` action takes (its row is made from them);
    ``timeout`` is not among them: there, the action's own limit bounds the child."""

    level: str = "quick"
    job: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    backend: str = "auto"
    expect_devices: int | None = None
    skip: tuple[str, ...] = ()
    timeout_scale: float = 1.0
    fail_below: float = Thresholds.fail_below
    warn_below: float = Thresholds.warn_below
    peer_fail: float = Thresholds.peer_fail
    peer_warn: float = Thresholds.peer_warn
    min_disk_gib: float = 10.0
    xid_window: float = 60.0  # minutes
    no_save: bool = False
    # The node's own files and tools, and how this process probes: given on the node (the
    # command's flags, --srun's tasks), never through a sidecar (LOCAL_OPTIONS).
    smi_tool: str | None = None
    baseline: tuple[str, ...] = ()
    disk: tuple[str, ...] = ()  # none: / and /tmp
    shared_fs: tuple[str, ...] | None = None  # None: $DYNPROF_HEALTHCHECK_SHARED_FS
    probe_timeout: float = PROBE_TIMEOUT_S
    counter_window: float = 0.0
    prometheus: str | None = None

    OPTIONS: ClassVar[dict[str, str]] = {
        "level": "str",
        "backend": "str",
        "expect_devices": "int",
        "skip": "strs",
        "timeout_scale": "float",
        "no_save": "bool",
        "fail_below": "float",
        "warn_below": "float",
        "peer_fail": "float",
        "peer_warn": "float",
        "min_disk_gib": "float",
        "xid_window": "float",
        "job": "str",
    }
    LOCAL_OPTIONS: ClassVar[dict[str, str]] = {
        "smi_tool": "str",
        "baseline": "strs",
        "disk": "strs",
        "shared_fs": "strs",
        "probe_timeout": "float",
        "counter_window": "float",
        "prometheus": "str",
    }

    def __post_init__(self) -> None:
        if not isinstance(self.level, str) or self.level not in LEVELS:
            raise errors.UsageError(f"--level {ascii(self.level)[:40]}: one of {', '.join(LEVELS)}")
        if self.job is not None:
            if not isinstance(self.job, str) or not self.job:
                raise errors.UsageError("a job is a non-empty text")
            if len(self.job) > MAX_JOB_CHARS:
                raise errors.UsageError(f"a job takes at most {MAX_JOB_CHARS} characters")
            if not self.job.isprintable():
                raise errors.UsageError("a job's name is printable text")
        _number("a timeout", self.timeout, MAX_TIMEOUT_S, open_low=True)
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise errors.UsageError(f"--backend {ascii(self.backend)[:40]}: one of {', '.join(BACKENDS)}")
        devices = self.expect_devices
        if devices is not None and (
            isinstance(devices, bool) or not isinstance(devices, int) or not 0 <= devices <= MAX_DEVICES
        ):
            raise errors.UsageError(f"--expect-devices {ascii(devices)[:40]}: an integer from 0 to {MAX_DEVICES}")
        if not isinstance(self.skip, tuple) or any(not isinstance(n, str) for n in self.skip):
            raise errors.UsageError("--skip is a list of check names")
        unknown = sorted(set(self.skip) - set(ALL_CHECKS))
        if unknown:
            raise errors.UsageError(f"unknown checks {ascii(unknown)[:200]}; known: {', '.join(ALL_CHECKS)}")
        _number("--timeout-scale", self.timeout_scale, MAX_TIMEOUT_SCALE, open_low=True)
        for name in ("fail_below", "warn_below", "peer_fail", "peer_warn"):
            _number("--" + name.replace("_", "-"), getattr(self, name), 1.0)
        _number("--min-disk-gib", self.min_disk_gib, MAX_DISK_GIB)
        _number("--xid-window", self.xid_window, MAX_XID_WINDOW_MIN)
        if not isinstance(self.no_save, bool):
            raise errors.UsageError("--no-save is true or false")
        for name in ("smi_tool", "prometheus"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_PATH_CHARS):
                raise errors.UsageError(f"--{name.replace('_', '-')} is a non-empty text")
        for name in ("baseline", "disk", "shared_fs"):
            _paths("--" + name.replace("_", "-"), getattr(self, name))
        _number("--probe-timeout", self.probe_timeout, MAX_PROBE_TIMEOUT_S, open_low=True)
        _number("--counter-window", self.counter_window, MAX_COUNTER_WINDOW_S)

    def to_json(self) -> dict[str, Any]:
        """Every field (lists for tuples); of :data:`LOCAL_OPTIONS` only those not at their
        defaults, so that a request made away from a node's files reads as it always did."""
        doc: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in self.LOCAL_OPTIONS or value != getattr(_DEFAULT, f.name):
                doc[f.name] = list(value) if isinstance(value, tuple) else value
        return doc

    def action_options(self) -> dict[str, Any]:
        """The options of the sidecar's ``healthcheck`` action for this request: those set (a
        false, empty or unset one left out), and of :data:`NEWER_ACTION_OPTIONS` only those not
        at their defaults, so that the sidecars of older releases still answer."""
        doc = self.to_json()
        out: dict[str, Any] = {}
        for key in self.OPTIONS:
            value = doc[key]
            if value is None or value is False or value == []:
                continue
            if key in NEWER_ACTION_OPTIONS and value == getattr(_DEFAULT, key):
                continue
            out[key] = value
        return out

    @classmethod
    def from_json(cls, doc: Any, *, local: bool = False) -> HealthcheckRequest:
        """The request of a JSON document (what the child and the sidecar's action read): a
        missing or null key takes its default; an unknown key, or anything else wrong, is a
        :class:`~dynprof.errors.UsageError`. ``local``: read on the node it checks (the child,
        --srun's tasks), so :data:`LOCAL_OPTIONS` are known too."""
        if not isinstance(doc, dict):
            raise errors.UsageError("a healthcheck request is a JSON object")
        most = MAX_REQUEST_KEYS + (len(cls.LOCAL_OPTIONS) if local else 0)
        if len(doc) > most:
            raise errors.UsageError(f"a healthcheck request has at most {most} keys, not {len(doc)}")
        known = (*cls.OPTIONS, "timeout", *(cls.LOCAL_OPTIONS if local else ()))
        for key in doc:
            if key not in known:
                raise errors.UsageError(
                    f"healthcheck: unknown option {str(key)[:80]!r}; known: {', '.join(sorted(known))}"
                )
        given = dict(doc)
        if "skip" in given and given["skip"] is not None:
            skip = given["skip"]
            items = skip if isinstance(skip, list) else [skip]
            if len(items) > len(ALL_CHECKS):
                raise errors.UsageError(f"--skip names at most {len(ALL_CHECKS)} checks")
            if any(not isinstance(n, str) for n in items):
                raise errors.UsageError("--skip is a list of check names")
            given["skip"] = tuple(sorted(set(items)))
        for key in ("baseline", "disk", "shared_fs"):
            if isinstance(given.get(key), list):
                if len(given[key]) > MAX_PATHS:
                    raise errors.UsageError(f"--{key.replace('_', '-')} names at most {MAX_PATHS} paths")
                given[key] = tuple(given[key])
        return cls(**{k: v for k, v in given.items() if v is not None})

    @classmethod
    def from_text(cls, data: bytes | str, *, local: bool = False, limit: int = MAX_REQUEST_BYTES) -> HealthcheckRequest:
        """The request of its JSON text, at most ``limit`` bytes (``local``: see :meth:`from_json`)."""
        size = len(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        if size > limit:
            raise errors.UsageError(f"a healthcheck request is at most {limit} bytes, not {size}")
        try:
            doc = loads_json(data, "the healthcheck request", max_depth=4)
        except errors.ArtifactError as exc:
            raise errors.UsageError(exc.message) from None
        return cls.from_json(doc, local=local)

    def options(self) -> Options:
        """The runner's options: those of ``dynprof healthcheck`` with the same flags."""
        return Options(
            level=self.level,
            backend=self.backend,
            smi_tool=self.smi_tool,
            expect_devices=self.expect_devices,
            disk_paths=list(self.disk) or ["/", "/tmp"],
            min_disk_gib=self.min_disk_gib,
            xid_window_s=self.xid_window * 60,
            thresholds=Thresholds(self.fail_below, self.warn_below, self.peer_fail, self.peer_warn),
            baseline_paths=list(self.baseline),
            skip=set(self.skip),
            timeout_scale=self.timeout_scale,
            probe_timeout_s=self.probe_timeout,
            shared_fs=None if self.shared_fs is None else list(self.shared_fs),
            counter_window_s=self.counter_window,
            job_pids=job_pids(self.job),
        )


# Options the healthcheck action takes since the job-wide healthcheck: sent only when they are
# not at their defaults (:meth:`HealthcheckRequest.action_options`).
NEWER_ACTION_OPTIONS = ("fail_below", "warn_below", "peer_fail", "peer_warn", "min_disk_gib", "xid_window")


def _paths(name: str, value: Any) -> None:
    """``value`` is a tuple of paths (``shared_fs`` may also be None)."""
    if value is None and name == "--shared-fs":
        return
    if not isinstance(value, tuple):
        raise errors.UsageError(f"{name} is a list of paths")
    if any(not isinstance(p, str) or not p or len(p) > MAX_PATH_CHARS for p in value):
        raise errors.UsageError(f"{name} is a list of paths")


def _number(name: str, value: Any, high: float, *, open_low: bool = False) -> None:
    """``value`` is a finite number from 0 (excluded when ``open_low``) to ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.UsageError(f"{name} of {ascii(value)[:40]}: not a number")
    if value > high or value < 0 or (open_low and value == 0):
        low = "more than 0" if open_low else "at least 0"
        raise errors.UsageError(f"{name} of {value:g}: {low}, at most {high:g}")


_DEFAULT = HealthcheckRequest()


def job_pids(job: str | None) -> frozenset[int]:
    """The pids of the live processes of ``job`` with dynprof agents on this node (this user's)."""
    if not job:
        return frozenset()
    try:
        return frozenset(r.pid for r in list_records(clean=False) if r.job_id == job)
    except OSError:
        return frozenset()


CHILD = (sys.executable, "-m", "healthcheck.collect")


def collect(request: HealthcheckRequest, command: tuple[str, ...] = CHILD) -> NodeReport:
    """Run the checks of ``request`` in a child process (``command OUT``, the request on its
    stdin), killed with its process group past ``request.timeout``; the report it wrote.

    Raises :class:`~dynprof.errors.Timeout` when it was killed, :class:`~dynprof.errors.ArtifactError`
    when what it wrote is not a report this version reads, and
    :class:`~dynprof.errors.DynprofError` when it could not start or wrote nothing (its stderr's
    last line says why)."""
    env = tool_env()
    with tempfile.TemporaryDirectory(prefix="dynprof-healthcheck-") as tmp:
        out = Path(tmp) / "report.json"
        with open(Path(tmp) / "stderr", "w+b") as err:
            try:
                proc = subprocess.Popen(
                    [*command, str(out)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                    start_new_session=True,  # its own process group: the smi tools it starts die with it
                )
            except OSError as exc:
                raise errors.DynprofError(f"the healthcheck could not start: {exc}") from None
            try:
                proc.communicate(jsontext.dumps(request.to_json()).encode(), timeout=request.timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait()
                raise errors.Timeout(
                    f"the healthcheck ran past {request.timeout:g} s and was killed",
                    help="A driver call that does not return hangs the checks: see `dynprof healthcheck` on the node.",
                ) from None
            except BrokenPipeError:  # it ended before reading its request: said below
                proc.wait()
            if not out.is_file():
                err.seek(0, os.SEEK_END)
                err.seek(max(0, err.tell() - STDERR_TAIL_BYTES))
                tail = err.read().decode("utf-8", "replace").strip().splitlines()[-1:]
                why = tail[0][:1000] if tail else "nothing on its stderr"
                raise errors.DynprofError(f"the healthcheck exited {proc.returncode} without a report: {why}")
        return read_report(out)


def read_report(path: Path) -> NodeReport:
    """The report the child wrote at ``path``, bounded and decoded; an
    :class:`~dynprof.errors.ArtifactError` says what is wrong with it."""
    with open(path, "rb") as f:
        data = f.read(MAX_REPORT_BYTES + 1)
    if len(data) > MAX_REPORT_BYTES:
        raise errors.ArtifactError(f"the healthcheck's report is over {MAX_REPORT_BYTES} bytes: refused")
    doc = loads_json(data, "the healthcheck's report", max_values=MAX_REPORT_VALUES)
    try:
        return NodeReport.from_json(doc)
    except ReportError as exc:
        raise errors.ArtifactError(f"the healthcheck's report is not one this version reads: {exc}") from None


@dataclass(frozen=True)
class Checked:
    """This node's checks run in this process (:func:`collect_here`): the report, the artifact it
    was saved as (None when not saved) and what to say on stderr (one line each, without the
    ``dynprof `` prefix)."""

    report: Report
    artifact: str | None
    messages: list[str]

    def to_json(self) -> dict[str, Any]:
        """The report's document with the artifact it was saved as (``--json``)."""
        data: dict[str, Any] = self.report.to_json()
        data["artifact"] = self.artifact
        return data


def collect_here(request: HealthcheckRequest, *, show_progress: bool = False) -> Checked:
    """Run the checks of ``request`` in this process; save the artifact (unless ``no_save``) and
    the Prometheus file it names. Progress, when ``show_progress``, goes only to a person watching
    (a terminal): never into a log, a pipe or an answer."""
    shown = show_progress and sys.stderr.isatty()

    def progress(text: str) -> None:
        if shown:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()

    report = run(request.options(), progress=progress)
    if shown:
        sys.stderr.write("\r\033[K")
    messages: list[str] = []
    artifact: str | None = None
    if not request.no_save:
        try:
            artifact = save_artifact(report, render_table(report))
        except (errors.ArtifactError, OSError) as exc:
            messages.append(f"healthcheck: results not saved: {exc}")
    if request.prometheus:
        try:
            write_atomically(request.prometheus, render_prometheus(report))
        except OSError as exc:
            raise errors.DynprofError(
                f"cannot write the Prometheus file {request.prometheus}: {exc.strerror or exc}",
                help="Point --prometheus at a writable file (the node exporter's textfile directory).",
            ) from None
    return Checked(report, artifact, messages)


def action_request(options: dict[str, Any]) -> HealthcheckRequest:
    """The sidecar's ``healthcheck`` action's options as the request; a value it refuses is the
    healthcheck's usage error (exit 3: 1 and 2 are the node's health)."""
    try:
        return HealthcheckRequest.from_json(options)
    except errors.DynprofError as exc:
        error = errors.UsageError(f"healthcheck: {exc.message}", help="See `dynprof healthcheck --help`.")
        error.exit_code = EXIT_COULD_NOT_RUN
        raise error from None


def action_collect(request: HealthcheckRequest) -> Result:
    """The sidecar's ``healthcheck`` action on this node: the checks for ``request`` (the
    report with the artifact it was saved as); an error is exit 3, whatever its own code."""
    try:
        checked = collect_here(request)
    except errors.DynprofError as exc:
        exc.exit_code = EXIT_COULD_NOT_RUN
        raise
    return Result(checked.to_json(), checked.report.exit_code, checked.messages)


# The sidecar's ``healthcheck`` action (the kinds' table names it): in a child of the sidecar,
# acting on the node, "could not run" is exit 3.
ACTION = ActionSpec(
    HealthcheckRequest,
    action_collect,
    decode=action_request,
    limits={
        "default_timeout_s": 900.0,
        "max_timeout_s": 900.0,
        "in_subprocess": True,
        "changes_jobs": True,
        "failed_exit": EXIT_COULD_NOT_RUN,
    },
)


def save_artifact(report: Report, table_text: str) -> str:
    data = report.to_json()
    job = os.environ.get("DYNPROF_JOB_ID") or os.environ.get("SLURM_JOB_ID") or None
    writer = ArtifactStore().create("healthcheck", job=job, host=report.host, options=report.options)
    writer.write_json("results.json", data)
    writer.write_text("report.txt", table_text + "\n")
    summary = {k: data[k] for k in ("level", "verdict", "exit_code", "counts", "actions", "duration_s")}
    return str(writer.finish("complete", summary=summary).path)


TASK_FLAG = "--task"


def task_command(request: HealthcheckRequest, python: str = sys.executable) -> list[str]:
    """One node's healthcheck as a task of a job-wide run (``--srun``): ``python -m
    healthcheck.collect --task REQUEST``, the request's JSON one argument; the task prints
    its report as ``--json`` does (:func:`task`)."""
    return [python, "-m", "healthcheck.collect", TASK_FLAG, jsontext.dumps(request.to_json())]


def task(text: str) -> int:
    """The task of :func:`task_command`: the checks of the request ``text`` run here, saved as an
    artifact unless it says not to, the report (with its artifact) printed on stdout as indented
    JSON; the exit code is the node's."""
    try:
        checked = collect_here(HealthcheckRequest.from_text(text, local=True, limit=MAX_LOCAL_REQUEST_BYTES))
    except errors.DynprofError as exc:
        print(f"healthcheck: error: {exc.message}", file=sys.stderr)
        if exc.help:
            print(f"  what to do: {exc.help}", file=sys.stderr)
        return EXIT_NO_REPORT
    for line in checked.messages:
        print(f"dynprof {line}", file=sys.stderr)
    print(jsontext.dumps(checked.to_json(), indent=2, default=str), flush=True)
    return checked.report.exit_code


def main(argv: list[str] | None = None) -> int:
    """The child: ``python -m healthcheck.collect OUT``, the request's JSON on stdin; or a task of
    a job-wide run, ``python -m healthcheck.collect --task REQUEST``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == TASK_FLAG:
        return task(args[1])
    if len(args) != 1:
        print("usage: python -m healthcheck.collect OUT  (the request's JSON on stdin)", file=sys.stderr)
        return EXIT_NO_REPORT
    try:
        request = HealthcheckRequest.from_text(sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1), local=True)
        report = run(request.options())
        write_atomically(args[0], jsontext.dumps(report.to_json()))
    except errors.DynprofError as exc:
        print(f"healthcheck: error: {exc.message}", file=sys.stderr)
        return EXIT_NO_REPORT
    except OSError as exc:
        print(f"healthcheck: error: cannot write the report to {args[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NO_REPORT
    return 0


if __name__ == "__main__":
    sys.exit(main())
