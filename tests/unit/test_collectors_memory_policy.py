"""History policies: parsing, names, and the options `dynprof run` turns into variables."""

from __future__ import annotations

import argparse

import pytest

from collectors.memory.policy import DEFAULT_POLICY, OFF, HistoryPolicy, PolicyError, parse_policy
from dynprof import errors
from dynprof.agent._ext_memory import MemoryOptions
from dynprof.cli import _run_memory


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("off", "off"),
        ("0", "off"),
        ("5000", "python:5000"),
        ("1_000", "python:1000"),
        ("all-stacks", f"all:{DEFAULT_POLICY.max_entries}"),
        ("all-stacks:2000", "all:2000"),
        ("python:77", "python:77"),
        ("all:77", "all:77"),
        ("state", "state"),
        ("auto", "auto"),
        ("auto:1%", "auto:1%"),
        ("auto:0.25", "auto:0.25%"),
        ("", DEFAULT_POLICY.describe()),
        (None, DEFAULT_POLICY.describe()),
    ],
)
def test_policies_parse_to_their_names(text, name):
    assert parse_policy(text).describe() == name


@pytest.mark.parametrize("name", ["off", "python:5000", "all:2000", "state", "auto", "auto:2%"])
def test_names_parse_back_to_the_same_policy(name):
    policy = parse_policy(name)
    assert parse_policy(policy.describe()) == policy


@pytest.mark.parametrize(
    "text",
    ["-5", "lots", "all-stacks:x", "python:0", "999999999999", "auto:0", "auto:-1%", "auto:75%", "auto:x", "auto:nan"],
)
def test_bad_policies_are_refused(text):
    with pytest.raises(PolicyError):
        parse_policy(text)


def test_default_is_auto_with_a_half_percent_budget_and_a_bounded_ring():
    assert DEFAULT_POLICY.mode == "auto" and DEFAULT_POLICY.budget == 0.005 and DEFAULT_POLICY.stacks == "python"
    assert 0 < DEFAULT_POLICY.max_entries <= 1_000_000
    assert not OFF.enabled and HistoryPolicy("state").enabled


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


def test_bad_variables_fall_back_to_defaults():
    opts = MemoryOptions.from_env(
        {
            "DYNPROF_MEMORY_HISTORY": "many",
            "DYNPROF_HOST_MEMORY_FRACTION": "2",
            "DYNPROF_MEMORY_OOM_MAX": "x",
            "DYNPROF_HOST_MEMORY_LIMIT": "lots",
        }
    )
    assert opts.history == DEFAULT_POLICY
    assert opts.host_fraction == MemoryOptions().host_fraction
    assert opts.oom_max == MemoryOptions().oom_max and opts.host_limit_bytes is None


def test_host_watch_can_be_turned_off():
    assert MemoryOptions.from_env({"DYNPROF_HOST_MEMORY_FRACTION": "off"}).host_fraction == 0.0
