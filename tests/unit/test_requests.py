"""The floor's decoder of kinds' requests: a JSON object of options, each of a kind, bounded."""

from __future__ import annotations

import pytest

from dynprof import errors
from dynprof.arguments import MAX_PID, MAX_SECONDS
from dynprof.requests import (
    MAX_ITEMS,
    MAX_TEXT,
    TARGETS,
    TargetedRequest,
    check_timeout,
    read_options,
)

SPEC = {"job": "str", "pid": "ints", "all": "bool", "n": "int", "t": "float", "names": "strs"}


def test_known_options_are_read_and_unset_ones_left_out():
    doc = {"job": "j", "pid": 7, "all": False, "n": 3, "t": 2, "names": ["a", "b"], "unset": None}
    with pytest.raises(errors.UsageError, match="unknown option 'unset'"):
        read_options(doc, SPEC, "x")
    del doc["unset"]
    got = read_options({**doc, "job": None}, SPEC, "x")
    # one item stands for a list of one; an integer is a number; None is unset
    assert got == {"pid": [7], "all": False, "n": 3, "t": 2.0, "names": ["a", "b"]}
    assert isinstance(got["t"], float)


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        (None, "must be a JSON object"),
        ({"nope": 1}, "unknown option 'nope'; known: all, job, n, names, pid, t"),
        ({"n": 1.0}, "'n' must be an integer"),
        ({"n": False}, "'n' must be an integer"),
        ({"t": float("nan")}, "'t' must be a finite number"),
        ({"names": ["a", 1]}, "'names' must be a list of strings"),
        ({"names": ["a" * (MAX_TEXT + 1)]}, "'names' must be a list of strings"),
        ({"names": ["a"] * (MAX_ITEMS + 1)}, "a list of 1 to"),
        ({"job": "x" * (MAX_TEXT + 1)}, f"at most {MAX_TEXT} characters"),
    ],
)
def test_what_is_not_an_option_of_its_kind_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        read_options(doc, SPEC, "x")
    assert said in refused.value.message and refused.value.message.startswith("x: ")


# -- the targets and the timeout every request of processes checks --------------------------------
@pytest.mark.parametrize(("pids", "job", "all_"), [((), None, False), ((1,), "j", False), ((), "j", True)])
def test_not_exactly_one_target_is_a_usage_error_pointing_at_the_commands_help(pids, job, all_):
    with pytest.raises(errors.UsageError, match="exactly one of --pid, --job or --all") as info:
        TargetedRequest(pids, job, all_).check_one_target("nccl")
    assert info.value.help == "See `dynprof nccl --help`."
    TargetedRequest(all=True).check_one_target("nccl")


@pytest.mark.parametrize("pid", [0, -1, MAX_PID + 1, True, 1.5, "7"])
def test_a_pid_that_is_no_process_id_is_a_usage_error(pid):
    with pytest.raises(errors.UsageError, match=f"a process id is 1-{MAX_PID}"):
        TargetedRequest(pids=(3, pid)).check_pids()
    TargetedRequest(pids=(1, MAX_PID)).check_pids()


@pytest.mark.parametrize("timeout", [0, -1.0, MAX_SECONDS + 1])
def test_a_timeout_out_of_range_is_a_usage_error(timeout):
    with pytest.raises(errors.UsageError, match=r"a timeout of .* s: more than 0, at most 86400"):
        check_timeout(timeout)
    check_timeout(MAX_SECONDS)


def test_targets_read_and_written_round_trip():
    for request in (TargetedRequest(pids=(4, 5)), TargetedRequest(job="j1"), TargetedRequest(all=True)):
        doc = request.targets_json()
        assert TargetedRequest(**TargetedRequest.targets_of(read_options(doc, TARGETS, "x"))) == request
    assert TargetedRequest(all=True).targets_json() == {"all": True}
    assert TargetedRequest().targets_json() == {}
