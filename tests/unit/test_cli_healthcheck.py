"""`dynprof healthcheck`'s job-wide options: what they refuse, and what they make of the job-wide
run (its request, its job-wide options)."""

from __future__ import annotations

import argparse

import pytest

from dynprof.cli import main
from dynprof.cli.healthcheck import job_wide
from dynprof.job.healthcheck import JobWide, Links
from healthcheck.arguments import request_from_args


def parse(*argv: str) -> argparse.Namespace:
    from dynprof.cli.healthcheck import HealthcheckCommand

    parser = argparse.ArgumentParser()
    HealthcheckCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--drain-command", "slurm"],  # job-wide only
        ["--peer-threshold", "0.2"],
        ["--hosts", "a:1", "--prometheus", "/tmp/x.prom"],  # a file of the node: does not travel
        ["--hosts", "a:1", "--smi-tool", "ppu-smi"],
        ["--hosts", "a:1", "--srun"],
        ["--peer-threshold", "0"],
        ["--peer-threshold", "nan"],
        ["--drain-command", "sh"],
    ],
)
def test_job_wide_options_misused_are_usage_errors_with_exit_3(argv, capsys):
    # WHEN the command is given options that do not fit together (or values it refuses)
    try:
        code = main(["healthcheck", *argv])
    except SystemExit as exc:  # argparse's own refusals exit there, with healthcheck's code
        code = exc.code

    # THEN it could not run (3): 2 would read as "unhealthy" to a scheduler
    assert code == 3
    assert "error" in capsys.readouterr().err


def test_the_job_wide_options_are_read_once_into_the_run():
    # GIVEN the job-wide flags
    args = parse("--srun", "--srun-arg=--overlap", "--srun-python=/opt/py", "--timeout=30", "--peer-threshold=0.2")
    # THEN the run gets them as given, and no link test unless asked
    assert job_wide(args) == JobWide(30.0, 0.2, ("--overlap",), "/opt/py", None)
    links = job_wide(parse("--hosts", "a:1", "--links", "--link-size", "1M", "--link-port", "3000"))
    assert links.links == Links(size_bytes=1 << 20, port=3000)


def test_the_node_options_travel_as_the_request():
    args = parse("--srun", "--level", "standard", "--skip", "disk_free,ib_ports", "--disk", "/scratch")
    request = request_from_args(args)
    assert (request.level, request.skip, request.disk) == ("standard", ("disk_free", "ib_ports"), ("/scratch",))
