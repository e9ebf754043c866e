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
from typing import Any

from dynprof import errors, jsontext
from dynprof.procs import kill_group
from dynprof.untrusted import loads_json
from healthcheck.fleet import NodeReport, ReportError
from healthcheck.runner import LEVELS, Options

DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
MAX_JOB_CHARS = 200
MAX_REQUEST_BYTES = 4096  # a request is a few dozen bytes
MAX_REQUEST_KEYS = 16
MAX_REPORT_BYTES = 16 << 20  # real reports are a few KiB to a few hundred KiB
MAX_REPORT_VALUES = 1_000_000
STDERR_TAIL_BYTES = 4096
EXIT_NO_REPORT = 3  # the child's exit when it wrote no report (the healthcheck's "could not run")


@dataclass(frozen=True)
class HealthcheckRequest:
    """What to check on this node: the ``level`` (``quick``: passive, seconds; ``standard``,
    ``full``), the ``job`` whose processes here are its own (not counted as others holding the
    devices), and the ``timeout`` past which the child running the checks is killed. Checked
    when made: a bad request raises :class:`~dynprof.errors.UsageError`."""

    level: str = "quick"
    job: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.level, str) or self.level not in LEVELS:
            raise errors.UsageError(f"level {ascii(self.level)[:40]}: one of {', '.join(LEVELS)}")
        if self.job is not None:
            if not isinstance(self.job, str) or not self.job:
                raise errors.UsageError("a job is a non-empty text")
            if len(self.job) > MAX_JOB_CHARS:
                raise errors.UsageError(f"a job takes at most {MAX_JOB_CHARS} characters")
            if not self.job.isprintable():
                raise errors.UsageError("a job's name is printable text")
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
            raise errors.UsageError(f"a timeout of {ascii(timeout)[:40]}: not a number of seconds")
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise errors.UsageError(f"a timeout of {timeout:g} s: more than 0, at most {MAX_TIMEOUT_S:g}")

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "job": self.job, "timeout": self.timeout}

    @classmethod
    def from_json(cls, doc: Any) -> HealthcheckRequest:
        """The request of a JSON document (what the child reads); unknown keys are ignored, a
        missing one takes its default; anything else wrong is a :class:`~dynprof.errors.UsageError`."""
        if not isinstance(doc, dict):
            raise errors.UsageError("a healthcheck request is a JSON object")
        if len(doc) > MAX_REQUEST_KEYS:
            raise errors.UsageError(f"a healthcheck request has at most {MAX_REQUEST_KEYS} keys, not {len(doc)}")
        level = doc.get("level", "quick")
        job = doc.get("job")
        timeout = doc.get("timeout", DEFAULT_TIMEOUT_S)
        return cls(level=level, job=job, timeout=timeout)

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
        """The runner's options: those of ``dynprof healthcheck --level LEVEL [--job JOB]``."""
        return Options(level=self.level, job_pids=job_pids(self.job))


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
