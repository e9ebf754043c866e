"""`dynprof watch`: its options, and its answer when the job has no agent to watch (exit 5 with
what to do), in-process."""

from __future__ import annotations

import argparse
import json

from dynprof.cli import main
from dynprof.cli.watch import HANG_EXIT, NO_AGENT_HELP, WatchCommand


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    WatchCommand().prepare_parser(parser)
    return parser.parse_args(list(argv))


def test_once_on_a_job_without_agents_is_exit_5_with_what_to_do(capsys):
    assert main(["watch", "--job", "no-such-job", "--once"]) == 5
    err = capsys.readouterr().err
    assert "no rank of job 'no-such-job' with a dynprof agent was found" in err
    assert "dynprof run" in err and "dynprof attach --job JOB" in err


def test_once_json_error_is_machine_readable(capsys):
    assert main(["watch", "--job", "j", "--once", "--json"]) == 5
    out = capsys.readouterr().out
    doc = json.loads(out[out.index('{\n  "error"') :])
    assert doc["error"]["type"] == "NoAgent" and doc["error"]["help"] == NO_AGENT_HELP


def test_a_job_name_over_200_characters_is_a_usage_error(capsys):
    assert main(["watch", "--job", "j" * 201, "--once"]) == 2
    assert "--job takes at most 200 characters" in capsys.readouterr().err


def test_the_job_is_required_and_max_seconds_is_positive(capsys):
    for argv in (["--once"], ["--job", "j", "--max-seconds", "0"]):
        try:
            _parse(*argv)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
    args = _parse("--job", "j", "--once", "--max-seconds", "2.5")
    assert args.job == "j" and args.once and args.max_seconds == 2.5


def test_the_hang_exit_code_is_documented_in_the_help():
    assert HANG_EXIT == 20
    assert "20 a hang verdict was given" in (WatchCommand.__doc__ or "")
