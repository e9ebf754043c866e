"""The healthcheck's options, one table for both faces (``dynprof healthcheck`` and ``python -m
healthcheck``): :func:`add_check_arguments` adds them to a parser, each a field of
:class:`~healthcheck.collect.HealthcheckRequest` with the request's default, and
:func:`request_from_args` reads them back as the request. Usage errors exit 3 ("could not
run"): 2 means "unhealthy" to a scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import NoReturn

from dynprof.arguments import bounded_int, nonnegative_float, parse_float, path_arg, positive_float
from healthcheck.checks.table import ALL_CHECKS
from healthcheck.collect import (
    BACKENDS,
    MAX_COUNTER_WINDOW_S,
    MAX_DEVICES,
    MAX_DISK_GIB,
    MAX_PROBE_TIMEOUT_S,
    MAX_TIMEOUT_SCALE,
    MAX_XID_WINDOW_MIN,
    HealthcheckRequest,
)
from healthcheck.options import LEVELS, SHARED_FS_ENV
from healthcheck.result import EXIT_COULD_NOT_RUN

_DEFAULT = HealthcheckRequest()
# The judgement's thresholds (fractions), each a field of the request: what its flag says.
THRESHOLDS = (
    ("fail_below", "fail a measurement below F x baseline"),
    ("warn_below", "warn below F x baseline"),
    ("peer_fail", "fail a device slower than its peers' median by F"),
    ("peer_warn", "warn a device slower than its peers' median by F"),
)

DESCRIPTION = """\
Check this node's accelerators and host before a job runs on it.

Levels: quick (passive: driver state, ECC, row remapping, XIDs, PCIe, clocks, NVLink, host;
seconds), standard (quick plus GEMM, memory and host-transfer bandwidth, a memory pattern test
and an all-reduce over the local devices, judged against the SKU baseline and the device's
peers; well under a minute), full (standard, longer).

Exit codes: 0 healthy, 1 warning, 2 unhealthy (drain the node), 3 could not run.
Results are saved as a `healthcheck` artifact (see `dynprof ls`).
"""


class UsageParser(argparse.ArgumentParser):
    """Usage errors exit 3 ("could not run"): 2 means "unhealthy" to a scheduler."""

    def error(self, message: str) -> NoReturn:
        _exit_3(self, message)


def _fraction(text: str) -> float:
    return parse_float(text, 0.0, 1.0, low_open=False, what="a fraction between 0 and 1")


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


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of one node's healthcheck (each a field of :class:`HealthcheckRequest`, whose
    defaults they take), and its ``baseline learn`` subcommand."""
    parser.add_argument(
        "--level", choices=LEVELS, default=_DEFAULT.level, help=f"how much to check (default: {_DEFAULT.level})"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=_DEFAULT.backend,
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
    for name, text in THRESHOLDS:
        default = getattr(_DEFAULT, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_fraction,
            default=default,
            metavar="F",
            help=f"{text} (default {default:.2f})",
        )
    parser.add_argument(
        "--disk", action="append", type=path_arg, metavar="PATH", help="check free space here (default: / and /tmp)"
    )
    parser.add_argument(
        "--min-disk-gib",
        type=nonnegative_float(MAX_DISK_GIB),
        default=_DEFAULT.min_disk_gib,
        metavar="GIB",
        help=f"warn below this much free disk (default {_DEFAULT.min_disk_gib:g})",
    )
    parser.add_argument(
        "--xid-window",
        type=nonnegative_float(MAX_XID_WINDOW_MIN),
        default=_DEFAULT.xid_window,
        metavar="MINUTES",
        help=f"look for XIDs in the kernel log this far back (default {_DEFAULT.xid_window:g})",
    )
    parser.add_argument(
        "--skip", type=_checks, default=set(), metavar="CHECK[,CHECK]", help="checks not to run (reported as skipped)"
    )
    parser.add_argument(
        "--timeout-scale",
        type=positive_float(MAX_TIMEOUT_SCALE),
        default=_DEFAULT.timeout_scale,
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
        default=_DEFAULT.probe_timeout,
        metavar="S",
        help="time limit of each passive probe; one that does not return is unknown "
        f"(default {_DEFAULT.probe_timeout:g})",
    )
    parser.add_argument(
        "--counter-window",
        type=nonnegative_float(MAX_COUNTER_WINDOW_S),
        default=_DEFAULT.counter_window,
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
    sub = parser.add_subparsers(dest="hc_command", metavar="{baseline}", parser_class=UsageParser)
    baseline = sub.add_parser("baseline", help="build baselines from results")
    baseline_sub = baseline.add_subparsers(dest="baseline_command", metavar="{learn}", parser_class=UsageParser)
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


def request_from_args(args: argparse.Namespace) -> HealthcheckRequest:
    """The request of the options :func:`add_check_arguments` parsed: each option is the
    request's field of its name, the lists made tuples (``--skip`` sorted)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(HealthcheckRequest) if f.name != "timeout"}
    given["skip"] = tuple(sorted(args.skip))
    for name in ("baseline", "disk", "shared_fs"):
        if given[name] is not None:
            given[name] = tuple(given[name])
    given["disk"] = given["disk"] or ()
    for name in ("job", "smi_tool"):  # given empty: as not given
        given[name] = given[name] or None
    return HealthcheckRequest(**given)


def usage_errors_exit_3(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (created by someone else) exit 3 on a usage error, like :class:`UsageParser`."""

    parser.error = lambda message: _exit_3(parser, message)  # type: ignore[method-assign]


def _exit_3(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.print_usage(sys.stderr)
    parser.exit(EXIT_COULD_NOT_RUN, f"{parser.prog}: error: {message}\n")
