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
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dynprof import errors, jsontext
from dynprof.procs import kill_group
from dynprof.untrusted import loads_json
from healthcheck.compare import Thresholds
from healthcheck.fleet import NodeReport, ReportError
from healthcheck.runner import ALL_CHECKS, LEVELS, Options

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
MAX_JOB_CHARS = 200
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes
MAX_REQUEST_KEYS = 16
MAX_REPORT_BYTES = 16 << 20  # real reports are a few KiB to a few hundred KiB
MAX_REPORT_VALUES = 1_000_000
STDERR_TAIL_BYTES = 4096
EXIT_NO_REPORT = 3  # the child's exit when it wrote no report (the healthcheck's "could not run")


BACKENDS = ("auto", "nvml", "smi")
MAX_TIMEOUT_SCALE = 100.0
MAX_DISK_GIB = 1_000_000.0
MAX_XID_WINDOW_MIN = 525_600.0  # a year
MAX_DEVICES = 4096


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
    fail_below: float = 0.90
    warn_below: float = 0.95
    peer_fail: float = 0.08
    peer_warn: float = 0.05
    min_disk_gib: float = 10.0
    xid_window: float = 60.0  # minutes
    no_save: bool = False

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

    def to_json(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "job": self.job,
            "timeout": self.timeout,
            "backend": self.backend,
            "expect_devices": self.expect_devices,
            "skip": list(self.skip),
            "timeout_scale": self.timeout_scale,
            "fail_below": self.fail_below,
            "warn_below": self.warn_below,
            "peer_fail": self.peer_fail,
            "peer_warn": self.peer_warn,
            "min_disk_gib": self.min_disk_gib,
            "xid_window": self.xid_window,
            "no_save": self.no_save,
        }

    @classmethod
    def from_json(cls, doc: Any) -> HealthcheckRequest:
        """The request of a JSON document (what the child and the sidecar's action read): a
        missing or null key takes its default; an unknown key, or anything else wrong, is a
        :class:`~dynprof.errors.UsageError`."""
        if not isinstance(doc, dict):
            raise errors.UsageError("a healthcheck request is a JSON object")
        if len(doc) > MAX_REQUEST_KEYS:
            raise errors.UsageError(f"a healthcheck request has at most {MAX_REQUEST_KEYS} keys, not {len(doc)}")
        known = (*cls.OPTIONS, "timeout")
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
        return cls(**{k: v for k, v in given.items() if v is not None})

    @classmethod
    def from_text(cls, data: bytes | str) -> HealthcheckRequest:
        """The request of its JSON text, at most :data:`MAX_REQUEST_BYTES`."""
        size = len(data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data)
        if size > MAX_REQUEST_BYTES:
            raise errors.UsageError(f"a healthcheck request is at most {MAX_REQUEST_BYTES} bytes, not {size}")
        try:
            doc = loads_json(data, "the healthcheck request", max_depth=4)
        except errors.ArtifactError as exc:
            raise errors.UsageError(exc.message) from None
        return cls.from_json(doc)

    def options(self) -> Options:
        """The runner's options: those of ``dynprof healthcheck`` with the same flags."""
        return Options(
            level=self.level,
            backend=self.backend,
            expect_devices=self.expect_devices,
            min_disk_gib=self.min_disk_gib,
            xid_window_s=self.xid_window * 60,
            thresholds=Thresholds(self.fail_below, self.warn_below, self.peer_fail, self.peer_warn),
            skip=set(self.skip),
            timeout_scale=self.timeout_scale,
            job_pids=job_pids(self.job),
        )


def _number(name: str, value: Any, high: float, *, open_low: bool = False) -> None:
    """``value`` is a finite number from 0 (excluded when ``open_low``) to ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise errors.UsageError(f"{name} of {ascii(value)[:40]}: not a number")
    if value > high or value < 0 or (open_low and value == 0):
        low = "more than 0" if open_low else "at least 0"
        raise errors.UsageError(f"{name} of {value:g}: {low}, at most {high:g}")


def job_pids(job: str | None) -> frozenset[int]:
    """The pids of the live processes of ``job`` with dynprof agents on this node (this user's)."""
    if not job:
        return frozenset()
    from dynprof.registry import list_records

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
    env = dict(os.environ)
    env.pop("DYNPROF", None)  # a tool, not a job: no agent in it
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


def main(argv: list[str] | None = None) -> int:
    """The child: ``python -m healthcheck.collect OUT``, the request's JSON on stdin."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m healthcheck.collect OUT  (the request's JSON on stdin)", file=sys.stderr)
        return EXIT_NO_REPORT
    from healthcheck.report import write_atomically
    from healthcheck.runner import run

    try:
        request = HealthcheckRequest.from_text(sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1))
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
