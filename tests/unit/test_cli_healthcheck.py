"""`dynprof healthcheck`'s job-wide options: what they refuse, what travels to the nodes, and how
srun's labelled output is read back per task."""

from __future__ import annotations

import argparse

import pytest

from dynprof.cli import main
from dynprof.cli.healthcheck import (
    MAX_TASK_OUTPUT_BYTES,
    MAX_TASK_OUTPUT_LINES,
    MAX_UNLABELLED_LINES,
    TaskOutput,
    srun_command,
)


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


def test_srun_runs_one_healthcheck_per_node_with_the_options_given():
    args = parse("--srun", "--level", "standard", "--skip", "disk_free,ib_ports", "--srun-arg=--overlap")
    argv = srun_command(args, 4)
    assert argv[:6] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--label", "--kill-on-bad-exit=0"]
    assert argv[6] == "--overlap"
    assert argv[8:12] == ["-m", "healthcheck", "--json", "--quiet"]
    assert "--level=standard" in argv and "--skip=disk_free,ib_ports" in argv


def test_labelled_output_is_split_per_task_and_bounded():
    # GIVEN the interleaved lines of three tasks (srun pads labels when there are ten or more)
    out = TaskOutput(3)
    for line in ['0: {"a":', " 1: nonsense", "0:  1}", "9: out of range", "no label", "2: " + "x" * 100]:
        out.add(line + "\n")
    out.add("2: " + "y" * MAX_TASK_OUTPUT_BYTES + "\n")

    # THEN each task has its own text; a task over its bound is refused as a whole
    assert out.lines[0] == ['{"a":', " 1}"] and out.lines[1] == ["nonsense"]
    assert 2 in out.over and 2 not in out.lines
    assert out.unlabelled == 2
    assert out.outcome(0, "n0", False).report == {"a": 1}
    assert not out.outcome(1, "n1", False).answered
    assert "over 4 MiB" in (out.outcome(2, "n2", False).error or "")


def test_a_task_of_short_lines_is_refused_by_its_line_bound_long_before_its_bytes():
    # GIVEN two tasks: one prints a report, the other short lines on and on
    out = TaskOutput(2)
    out.add_lines([b"0: {", b'0:   "a": 1', b"0: }"])
    out.add_lines([b"1: x"] * (MAX_TASK_OUTPUT_LINES + 1))
    # THEN the chatty one is over its bound (a few hundred kB, far under 4 MiB), nothing of it
    # kept, and every task is decided, so srun can be stopped
    assert 1 in out.over and 1 not in out.lines and out.sizes[1] < MAX_TASK_OUTPUT_BYTES
    assert out.decided() and out.flooded()
    assert out.outcome(0, "n0", False).report == {"a": 1}
    assert out.outcome(1, "n1", False).error == f"its task printed over {MAX_TASK_OUTPUT_LINES} lines: refused"


def test_lines_that_name_no_task_are_bounded_and_the_unanswered_tasks_named():
    # GIVEN a task that answered, one half way through its report, and srun printing lines
    # that name no task of the allocation
    out = TaskOutput(3)
    out.add_lines([b"0: {", b'0:   "a": 1', b"0: }", b"1: {", b'1:   "b":'])
    out.add_lines([b"no label"] * MAX_UNLABELLED_LINES)
    assert not out.noisy()
    # WHEN one more comes
    out.add_lines([b"7: another allocation's task"])
    # THEN srun is to be stopped, and the tasks that had not answered say that it was
    assert out.noisy()
    assert out.outcome(0, "n0", False, stopped=True).report == {"a": 1}
    assert out.outcome(1, "n1", False, stopped=True).error == "srun was stopped before its task answered"
    assert out.outcome(2, "n2", False, stopped=True).error == "srun was stopped before its task answered"


def test_options_at_their_defaults_are_not_sent_to_the_sidecars():
    # GIVEN the job-wide options, one threshold changed
    from dynprof.cli.healthcheck import _at_default
    from dynprof.cli.job import forward_options

    args = parse("--hosts", "a:1", "--fail-below", "0.8", "--skip", "disk_free")

    # WHEN the healthcheck action's options are made
    options = forward_options("healthcheck", args, skip=sorted(args.skip), **_at_default(args))

    # THEN the changed one travels, the others at their defaults stay home (older sidecars know none of them)
    assert options["fail_below"] == 0.8 and options["skip"] == ["disk_free"] and options["level"] == "quick"
    assert not {"warn_below", "peer_fail", "peer_warn", "min_disk_gib", "xid_window"} & set(options)
