"""The healthcheck command line, shared by ``dynprof healthcheck`` and ``python -m healthcheck``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from dynprof import jsontext
from dynprof.arguments import bounded_int, nonnegative_float, parse_float, path_arg, positive_float
from dynprof.errors import ArtifactError, DynprofError
from healthcheck.baseline import learn, read_results
from healthcheck.collect import (
    BACKENDS,
    MAX_DEVICES,
    MAX_DISK_GIB,
    MAX_TIMEOUT_SCALE,
    MAX_XID_WINDOW_MIN,
    HealthcheckRequest,
    job_pids,
)
from healthcheck.compare import Thresholds
from healthcheck.report import Report, render_prometheus, render_table, write_atomically
from healthcheck.result import EXIT_COULD_NOT_RUN
from healthcheck.runner import ALL_CHECKS, LEVELS, SHARED_FS_ENV, Options, run
from healthcheck.timeouts import PROBE_TIMEOUT_S

DESCRIPTION = """\
Check this node's accelerators and host before a job runs on it.

Levels: quick (passive: driver state, ECC, row remapping, XIDs, PCIe, clocks, NVLink, host;
seconds), standard (quick plus GEMM, memory and host-transfer bandwidth, a memory pattern test
and an all-reduce over the local devices, judged against the SKU baseline and the device's
peers; well under a minute), full (standard, longer).

Exit codes: 0 healthy, 1 warning, 2 unhealthy (drain the node), 3 could not run.
Results are saved as a `healthcheck` artifact (see `dynprof ls`).
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 3 ("could not run"): 2 means "unhealthy" to a scheduler."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_COULD_NOT_RUN, f"{self.prog}: error: {message}\n")


def _fraction(text: str) -> float:
    return parse_float(text, 0.0, 1.0, low_open=False, what="a fraction between 0 and 1")


MAX_PROBE_TIMEOUT_S = 600.0
MAX_COUNTER_WINDOW_S = 600.0


def _output_file(text: str) -> str:
    """A file we can create: its directory exists, and it is not itself a directory."""
    path = Path(path_arg(text))
    parent = path.parent if str(path.parent) else Path(".")
    if not text.strip():
        raise argparse.ArgumentTypeError("empty file name")
    if len(path.name.encode("utf-8", "surrogateescape")) > 255:
        raise argparse.ArgumentTypeError("file name longer than 255 bytes")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {ascii(str(parent))[1:-1]} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{ascii(text)[1:-1]} is a directory")
    return text


def _checks(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(ALL_CHECKS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown checks {sorted(unknown)}; known: {', '.join(ALL_CHECKS)}")
    return names


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--level", choices=LEVELS, default="quick", help="how much to check (default: quick)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="how to read the devices (default: NVML, else an smi tool)",
    )
    parser.add_argument("--smi-tool", metavar="NAME", help="nvidia-smi-style tool for --backend smi (e.g. ppu-smi)")
    parser.add_argument(
        "--expect-devices",
        type=bounded_int(0, MAX_DEVICES),
        metavar="N",
        help="devices this node must have (default: $DYNPROF_EXPECT_DEVICES, $SLURM_GPUS_ON_NODE); "
        "0 on a node without accelerators",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument(
        "--prometheus", type=_output_file, metavar="FILE", help="also write Prometheus text format to FILE (atomically)"
    )
    parser.add_argument(
        "--baseline",
        action="append",
        type=path_arg,
        default=[],
        metavar="FILE",
        help="baseline file (from `baseline learn`); wins over the shipped ones",
    )
    parser.add_argument(
        "--fail-below",
        type=_fraction,
        default=0.90,
        metavar="F",
        help="fail a measurement below F x baseline (default 0.90)",
    )
    parser.add_argument(
        "--warn-below", type=_fraction, default=0.95, metavar="F", help="warn below F x baseline (default 0.95)"
    )
    parser.add_argument(
        "--peer-fail",
        type=_fraction,
        default=0.08,
        metavar="F",
        help="fail a device slower than its peers' median by F (default 0.08)",
    )
    parser.add_argument(
        "--peer-warn",
        type=_fraction,
        default=0.05,
        metavar="F",
        help="warn a device slower than its peers' median by F (default 0.05)",
    )
    parser.add_argument(
        "--disk", action="append", type=path_arg, metavar="PATH", help="check free space here (default: / and /tmp)"
    )
    parser.add_argument(
        "--min-disk-gib",
        type=nonnegative_float(MAX_DISK_GIB),
        default=10.0,
        metavar="GIB",
        help="warn below this much free disk (default 10)",
    )
    parser.add_argument(
        "--xid-window",
        type=nonnegative_float(MAX_XID_WINDOW_MIN),
        default=60.0,
        metavar="MINUTES",
        help="look for XIDs in the kernel log this far back (default 60)",
    )
    parser.add_argument(
        "--skip", type=_checks, default=set(), metavar="CHECK[,CHECK]", help="checks not to run (reported as skipped)"
    )
    parser.add_argument(
        "--timeout-scale",
        type=positive_float(MAX_TIMEOUT_SCALE),
        default=1.0,
        metavar="X",
        help=f"multiply every check's timeout by X (0 < X <= {MAX_TIMEOUT_SCALE:g})",
    )
    parser.add_argument(
        "--shared-fs",
        action="append",
        type=path_arg,
        metavar="PATH",
        help="probe this shared filesystem (statvfs and a 4 KiB file write/read) under the probe time limit; "
        f"repeatable (default: ${SHARED_FS_ENV}, ':'-separated)",
    )
    parser.add_argument(
        "--probe-timeout",
        type=positive_float(MAX_PROBE_TIMEOUT_S),
        default=PROBE_TIMEOUT_S,
        metavar="S",
        help=f"time limit of each passive probe; one that does not return is unknown (default {PROBE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--counter-window",
        type=nonnegative_float(MAX_COUNTER_WINDOW_S),
        default=0.0,
        metavar="S",
        help="read the error counters at least S seconds apart (default 0: at the start and the end of the run)",
    )
    parser.add_argument(
        "--job",
        metavar="JOB",
        help="the job this node runs: its processes with dynprof agents here are not counted as other processes "
        "holding the devices (device_processes)",
    )
    parser.add_argument("--failures-only", action="store_true", help="table: leave out passed and skipped checks")
    parser.add_argument("--no-save", action="store_true", help="do not save the results as an artifact")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sub = parser.add_subparsers(dest="hc_command", metavar="{baseline}", parser_class=_Parser)
    baseline = sub.add_parser("baseline", help="build baselines from results")
    baseline_sub = baseline.add_subparsers(dest="baseline_command", metavar="{learn}", parser_class=_Parser)
    baseline_sub.required = True
    learn_p = baseline_sub.add_parser(
        "learn",
        help="build a per-SKU baseline (median and spread) from many nodes' JSON results",
        description="Build a per-SKU baseline (median and spread of every measurement) from the JSON results "
        "of `dynprof healthcheck --level standard --json`, artifact directories, or directories holding them.",
    )
    learn_p.add_argument("results", nargs="+", type=path_arg, metavar="RESULTS", help="result files or directories")
    learn_p.add_argument(
        "-o", "--output", type=_output_file, metavar="FILE", help="write the baseline here (default: stdout)"
    )
    learn_p.add_argument("--source", default="", help="describe where the results come from")


def options_from_args(args: argparse.Namespace) -> Options:
    return Options(
        level=args.level,
        backend=args.backend,
        smi_tool=args.smi_tool,
        expect_devices=args.expect_devices,
        disk_paths=args.disk or ["/", "/tmp"],
        min_disk_gib=args.min_disk_gib,
        xid_window_s=args.xid_window * 60,
        thresholds=Thresholds(args.fail_below, args.warn_below, args.peer_fail, args.peer_warn),
        baseline_paths=args.baseline,
        skip=set(args.skip),
        timeout_scale=args.timeout_scale,
        probe_timeout_s=getattr(args, "probe_timeout", PROBE_TIMEOUT_S),
        shared_fs=getattr(args, "shared_fs", None),
        counter_window_s=getattr(args, "counter_window", 0.0),
        job_pids=job_pids(getattr(args, "job", None)),
    )


def save_artifact(report: Report, table_text: str) -> str:
    from dynprof.store import ArtifactStore

    data = report.to_json()
    job = os.environ.get("DYNPROF_JOB_ID") or os.environ.get("SLURM_JOB_ID") or None
    writer = ArtifactStore().create("healthcheck", job=job, host=report.host, options=report.options)
    writer.write_json("results.json", data)
    writer.write_text("report.txt", table_text + "\n")
    summary = {k: data[k] for k in ("level", "verdict", "exit_code", "counts", "actions", "duration_s")}
    return str(writer.finish("complete", summary=summary).path)


def check(args: argparse.Namespace) -> tuple[Report, str | None, list[str]]:
    """Run the checks ``args`` ask for; save the artifact and the Prometheus file they name.

    Returns the report, the artifact's path (None when not saved) and what to say on stderr
    (one line each, without the ``dynprof `` prefix). Progress goes only to a person watching
    (a terminal): never into a log, a pipe or an answer."""
    return check_options(options_from_args(args), no_save=args.no_save, prometheus=args.prometheus, quiet=args.quiet)


def check_request(request: HealthcheckRequest) -> tuple[Report, str | None, list[str]]:
    """:func:`check` for a request (the sidecar's ``healthcheck`` action): its checks, in this
    process, saved as an artifact unless ``no_save``; no progress, no Prometheus file."""
    return check_options(request.options(), no_save=request.no_save, prometheus=None, quiet=True)


def check_options(
    options: Options, *, no_save: bool, prometheus: str | None, quiet: bool
) -> tuple[Report, str | None, list[str]]:
    show_progress = not quiet and sys.stderr.isatty()

    def progress(text: str) -> None:
        if show_progress:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()

    report = run(options, progress=progress)
    if show_progress:
        sys.stderr.write("\r\033[K")
    messages: list[str] = []
    artifact: str | None = None
    if not no_save:
        try:
            artifact = save_artifact(report, render_table(report))
        except (ArtifactError, OSError) as exc:
            messages.append(f"healthcheck: results not saved: {exc}")
    if prometheus:
        try:
            write_atomically(prometheus, render_prometheus(report))
        except OSError as exc:
            raise DynprofError(
                f"cannot write the Prometheus file {prometheus}: {exc.strerror or exc}",
                help="Point --prometheus at a writable file (the node exporter's textfile directory).",
            ) from None
    return report, artifact, messages


def run_command(args: argparse.Namespace) -> int:
    if getattr(args, "hc_command", None) == "baseline":
        return learn_command(args)
    report, artifact, messages = check(args)
    for line in messages:
        print(f"dynprof {line}", file=sys.stderr)
    if args.json:
        data: dict[str, Any] = report.to_json()
        data["artifact"] = artifact
        print(jsontext.dumps(data, indent=2, default=str))
    else:
        print(render_table(report, show_passed=not args.failures_only))
        if artifact:
            print(f"saved: {artifact}")
    return report.exit_code


def learn_command(args: argparse.Namespace) -> int:
    results = read_results(args.results)
    baseline = learn(results, source=args.source)
    text = json.dumps(baseline, indent=2) + "\n"
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise DynprofError(f"cannot write the baseline to {args.output}: {exc.strerror or exc}") from None
        skus = ", ".join(f"{b['sku']['name']} {b['sku']['memory_gib']}GiB" for b in baseline["baselines"])
        print(f"baseline for {skus} from {len(results)} results written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def usage_errors_exit_3(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (created by someone else) exit 3 on a usage error, like :class:`_Parser`."""

    def error(message: str) -> NoReturn:
        parser.print_usage(sys.stderr)
        parser.exit(EXIT_COULD_NOT_RUN, f"{parser.prog}: error: {message}\n")

    parser.error = error  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m healthcheck", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    prepare_parser(parser)
    args = parser.parse_args(argv)
    code: int | None = None
    try:
        code = run_command(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): the verdict, if there was one, stands as the exit code;
        # never "healthy" by default.
        from dynprof.output import silence_stdout

        silence_stdout()
        return EXIT_COULD_NOT_RUN if code is None else code
    except DynprofError as exc:
        print(f"healthcheck: error: {exc.message}", file=sys.stderr)
        if exc.help:
            print(f"  what to do: {exc.help}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
