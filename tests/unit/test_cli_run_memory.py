"""dynprof.cli._run_memory: the memory-capture options of `dynprof run` (and `dynprof attach`),
checked and turned into the variables the agent reads."""

from __future__ import annotations

import argparse

import pytest

from collectors.memory.policy import DEFAULT_POLICY
from dynprof import errors
from dynprof.agent._ext_memory import MemoryOptions
from dynprof.cli import _run_memory, main
from dynprof.cli._run_options import RUN_OPTIONS, load_run_options


def _run_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _run_memory.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_options_set_the_variables_the_agent_reads():
    # GIVEN every memory option of `dynprof run`
    args = _run_args(
        "--memory-history",
        "all-stacks:3000",
        "--memory-oom-interval",
        "5",
        "--memory-oom-max",
        "2",
        "--host-memory-fraction",
        "0.8",
        "--host-memory-limit",
        "2G",
    )
    env: dict[str, str] = {}

    # WHEN they are applied
    _run_memory.apply(args, env)

    # THEN the agent's options read back the same values
    opts = MemoryOptions.from_env(env)
    assert opts.history.describe() == "all:3000"
    assert opts.oom_interval_s == 5.0 and opts.oom_max == 2
    assert opts.host_fraction == 0.8 and opts.host_limit_bytes == 2 * 2**30


def test_no_options_leave_the_environment_alone():
    env: dict[str, str] = {}
    _run_memory.apply(_run_args(), env)
    assert env == {}
    assert MemoryOptions.from_env(env).history == DEFAULT_POLICY


@pytest.mark.parametrize(
    "argv",
    [
        ["--memory-history", "many"],
        ["--host-memory-fraction", "1.5"],
        ["--host-memory-fraction", "x"],
        ["--host-memory-limit", "lots"],
    ],
)
def test_bad_run_options_are_usage_errors(argv):
    with pytest.raises(errors.UsageError):
        _run_memory.apply(_run_args(*argv), {})


@pytest.mark.parametrize(
    "argv",
    [
        ["--memory-oom-max", "-1"],
        ["--memory-oom-max", "99999999999999999999"],
        ["--memory-oom-interval", "nan"],
        ["--memory-oom-interval", "-1"],
    ],
)
def test_bad_run_numbers_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _run_args(*argv)
    assert info.value.code == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "variable"),
    [("off", "off"), ("0", "off"), (" OFF ", "off"), ("1", "1.0"), ("0.25", "0.25"), ("1e-3", "0.001")],
)
def test_the_host_memory_fraction_is_a_fraction_or_off(text, variable):
    env: dict[str, str] = {}
    _run_memory.apply(_run_args("--host-memory-fraction", text), env)
    assert env == {"DYNPROF_HOST_MEMORY_FRACTION": variable}


@pytest.mark.parametrize("text", ["-0.5", "0.0", "1.0001", "nan", "inf", "-inf", "", "0x1", "\x1b[2J"])
def test_a_host_memory_fraction_out_of_range_is_refused_quoted(text):
    with pytest.raises(errors.UsageError) as info:
        _run_memory.apply(_run_args(f"--host-memory-fraction={text}"), {})
    assert info.value.message == f"--host-memory-fraction {text!r} is not a number in (0, 1] or off"


def test_the_oom_limits_keep_their_zero():
    # 0 is a real setting: no pause between captures, and no OOM capture at all
    env: dict[str, str] = {}
    _run_memory.apply(_run_args("--memory-oom-interval", "0", "--memory-oom-max", "0"), env)
    assert env == {"DYNPROF_MEMORY_OOM_INTERVAL_S": "0.0", "DYNPROF_MEMORY_OOM_MAX": "0"}
    assert MemoryOptions.from_env(env).oom_max == 0


@pytest.mark.parametrize(
    ("option", "said"), [("memory_oom_interval", "--memory-oom-interval"), ("memory_oom_max", "--memory-oom-max")]
)
def test_negative_oom_limits_from_another_parser_are_refused(option, said):
    # apply() is also given namespaces the CLI's parser did not make (attach's, a sidecar action's)
    with pytest.raises(errors.UsageError) as info:
        _run_memory.apply(argparse.Namespace(**{option: -1}), {})
    assert info.value.message == f"{said} must be >= 0"


def test_a_bad_history_policy_says_what_it_takes():
    with pytest.raises(errors.UsageError) as info:
        _run_memory.apply(_run_args("--memory-history", "lots"), {})
    assert info.value.message.startswith("--memory-history: ")
    assert "all-stacks" in (info.value.help or "")


@pytest.mark.parametrize(("text", "variable"), [("off", "off"), ("auto:1%", "auto:1%"), ("state", "state")])
def test_the_history_policy_is_written_by_its_name(text, variable):
    env: dict[str, str] = {}
    _run_memory.apply(_run_args("--memory-history", text), env)
    assert env == {"DYNPROF_MEMORY_HISTORY": variable}


def test_a_bad_host_memory_limit_keeps_the_sizes_help():
    with pytest.raises(errors.UsageError) as info:
        _run_memory.apply(_run_args("--host-memory-limit", "12 parsecs"), {})
    assert info.value.message == "--host-memory-limit: cannot read size '12 parsecs'"
    assert info.value.help == "Write it as bytes or with K, M, G, T."


def test_a_namespace_without_the_options_changes_nothing():
    env = {"KEEP": "1"}
    _run_memory.apply(argparse.Namespace(), env)
    assert env == {"KEEP": "1"}


def test_the_options_are_among_the_run_options():
    load_run_options()
    assert (_run_memory.add_arguments, _run_memory.apply) in RUN_OPTIONS


def test_run_refuses_a_bad_option_before_running_anything(capsys):
    # the command would run `true`; the bad fraction ends `dynprof run` first, exit 2
    assert main(["run", "--host-memory-fraction", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "--host-memory-fraction '2' is not a number in (0, 1] or off" in err
    assert "agent enabled" not in err
