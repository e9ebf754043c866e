"""healthcheck.arguments: the one option table of both faces; what the command line makes of
the request, its defaults the request's, and usage errors that exit 3."""

from __future__ import annotations

import argparse

import pytest

from healthcheck.arguments import UsageParser, add_check_arguments, request_from_args, usage_errors_exit_3
from healthcheck.collect import HealthcheckRequest
from healthcheck.timeouts import PROBE_TIMEOUT_S


def parse(argv: list[str]) -> argparse.Namespace:
    parser = UsageParser(prog="python -m healthcheck")
    add_check_arguments(parser)
    return parser.parse_args(argv)


def test_the_defaults_are_the_requests():
    # WHEN nothing is given, the command line's request is the request's defaults
    assert request_from_args(parse([])) == HealthcheckRequest()


def test_every_option_reaches_the_request():
    args = parse(
        [
            "--level=full",
            "--backend=smi",
            "--smi-tool=ppu-smi",
            "--expect-devices=8",
            "--baseline=/b1.json",
            "--baseline=/b2.json",
            "--disk=/d",
            "--shared-fs=/lustre",
            "--probe-timeout=3",
            "--counter-window=2",
            "--timeout-scale=2",
            "--min-disk-gib=5",
            "--xid-window=30",
            "--skip=ecc_errors,clock_events",
            "--job=j7",
            "--no-save",
        ]
    )
    request = request_from_args(args)
    assert request == HealthcheckRequest(
        level="full",
        backend="smi",
        smi_tool="ppu-smi",
        expect_devices=8,
        baseline=("/b1.json", "/b2.json"),
        disk=("/d",),
        shared_fs=("/lustre",),
        probe_timeout=3.0,
        counter_window=2.0,
        timeout_scale=2.0,
        min_disk_gib=5.0,
        xid_window=30.0,
        skip=("clock_events", "ecc_errors"),
        job="j7",
        no_save=True,
    )


def test_a_usage_error_of_the_parser_exits_3(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--fail-below", "2"])
    assert info.value.code == 3
    assert "error:" in capsys.readouterr().err


def test_options_carry_the_command_line_to_the_runner():
    # GIVEN a command line with every conversion the runner relies on
    args = parse(
        [
            "--level",
            "standard",
            "--xid-window",
            "30",
            "--fail-below",
            "0.8",
            "--warn-below",
            "0.9",
            "--peer-fail",
            "0.2",
            "--peer-warn",
            "0.1",
            "--skip",
            " ecc_errors , ,clock_events",
            "--disk",
            "/scratch",
            "--expect-devices",
            "0",
        ]
    )
    # WHEN made into options
    options = request_from_args(args).options()
    # THEN minutes became seconds, the thresholds are in order, and the skip list is clean
    assert options.level == "standard"
    assert options.xid_window_s == 1800.0
    th = options.thresholds
    assert (th.fail_below, th.warn_below, th.peer_fail, th.peer_warn) == (0.8, 0.9, 0.2, 0.1)
    assert options.skip == {"ecc_errors", "clock_events"}
    assert options.disk_paths == ["/scratch"]
    assert options.expect_devices == 0
    assert options.job_pids == frozenset()


def test_default_options_check_root_and_tmp_with_the_default_limits():
    options = request_from_args(parse([])).options()
    assert options.disk_paths == ["/", "/tmp"]
    assert (options.level, options.backend, options.expect_devices) == ("quick", "auto", None)
    assert options.probe_timeout_s == PROBE_TIMEOUT_S
    assert options.counter_window_s == 0.0


def test_usage_errors_exit_3_changes_a_parser_made_elsewhere(capsys):
    parser = argparse.ArgumentParser(prog="dynprof healthcheck")
    parser.add_argument("--n", type=int)
    usage_errors_exit_3(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--n", "x"])
    assert info.value.code == 3
    assert "dynprof healthcheck: error:" in capsys.readouterr().err


def test_an_empty_job_or_smi_tool_is_as_not_given():
    request = request_from_args(parse(["--job", "", "--smi-tool", ""]))
    assert (request.job, request.smi_tool) == (None, None)
    assert request.options().job_pids == frozenset()
