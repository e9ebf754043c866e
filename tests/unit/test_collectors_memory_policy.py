"""History policies: parsing, names, and the agent's reading of the variables that `dynprof run`
sets (the options themselves: test_cli_run_memory.py)."""

from __future__ import annotations

import pytest

from collectors.memory.policy import DEFAULT_POLICY, OFF, HistoryPolicy, PolicyError, parse_policy
from dynprof.agent._ext_memory import MemoryOptions


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


@pytest.mark.parametrize("text", ["\u0661\u0660\u0660", "python:\u0661\u0660", "auto:\u0660.\u0665%"])
def test_a_policy_takes_ascii_digits_only(text):
    # GIVEN entries or a budget written with another script's digits WHEN parsed THEN refused
    with pytest.raises(PolicyError):
        parse_policy(text)
