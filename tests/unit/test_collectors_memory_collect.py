"""The memory kind's requests (snapshot/history, plan): checked when made, read from JSON without
trusting it, and the same request whichever way it comes (the CLI's options, or the sidecar's
``memory`` and ``memory-plan`` actions)."""

from __future__ import annotations

import os

import pytest

from collectors.memory.collect import MemoryPlanRequest, MemoryRequest, collect, collect_plan
from collectors.memory.plan.budget import parse_budget
from dynprof import errors
from dynprof.cli.memory import MemoryCommand, plan_request_from_args, request_from_args
from dynprof.requests import MAX_ITEMS, MAX_TEXT
from tests.unit._action_flags import read_options


@pytest.mark.parametrize(
    ("kind", "kwargs", "said"),
    [
        (MemoryRequest, {}, "exactly one of --pid, --job or --all"),
        (MemoryRequest, {"job": "j", "all": True}, "exactly one of --pid, --job or --all"),
        (MemoryRequest, {"pids": (0,)}, "a process id is 1-"),
        (MemoryRequest, {"job": "j", "history_start": 0}, "--history-start N needs"),
        (MemoryRequest, {"job": "j", "history_start": 5, "history_stop": True}, "not both"),
        (MemoryRequest, {"job": "j", "stacks": "cpp"}, "--stacks 'cpp'"),
        (MemoryRequest, {"job": "j", "timeout": 0.0}, "a timeout of 0 s"),
        (MemoryPlanRequest, {"job": "j"}, "needs --budget SIZE or --save SIZE"),
        (MemoryPlanRequest, {"job": "j", "budget": "40G", "save": "8G"}, "not both"),
        (MemoryPlanRequest, {"job": "j", "budget": "140%"}, "between 0 and 100"),
        (MemoryPlanRequest, {"job": "j", "save": "lots"}, "--budget/--save 'lots'"),
        (MemoryPlanRequest, {"budget": "40G"}, "exactly one of --pid, --job or --all"),
    ],
)
def test_a_memory_or_plan_request_that_cannot_be_run_is_refused_when_made(kind, kwargs, said):
    with pytest.raises(errors.UsageError) as refused:
        kind(**kwargs)
    assert said in refused.value.message


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"job": "j1"}, MemoryRequest(job="j1")),
        ({"pid": [7, 8], "timeout": 4.0}, MemoryRequest(pids=(7, 8), timeout=4.0)),
        (
            {"all": True, "history_start": 1000, "stacks": "all"},
            MemoryRequest(all=True, history_start=1000, stacks="all"),
        ),
        ({"job": "j", "history_stop": True}, MemoryRequest(job="j", history_stop=True)),
    ],
)
def test_the_memory_action_s_options_are_the_request_both_ways(options, expected):
    # WHEN a node's sidecar turns the action's options into the command's arguments, or reads them as JSON
    from_cli = request_from_args(read_options("memory", MemoryCommand(), options))
    from_json = MemoryRequest.from_json(options)
    # THEN the kind is asked exactly that, and the request writes itself back as the same options
    assert from_cli == from_json == expected
    assert MemoryRequest.from_json(expected.to_json()) == expected


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"job": "j1", "budget": "60%"}, MemoryPlanRequest(job="j1", budget="60%")),
        ({"pid": [3], "save": "8G", "timeout": 20}, MemoryPlanRequest(pids=(3,), save="8G", timeout=20.0)),
    ],
)
def test_the_memory_plan_action_s_options_are_the_request_both_ways(options, expected):
    from_cli = plan_request_from_args(read_options("memory-plan", MemoryCommand(), options))
    assert from_cli == MemoryPlanRequest.from_json(options) == expected
    assert MemoryPlanRequest.from_json(expected.to_json()) == expected


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ([], "must be a JSON object"),
        ("job=j", "must be a JSON object"),
        ({"job": "j", "output": "/etc/passwd"}, "unknown option 'output'"),
        ({"job": "j", 5: 1}, "unknown option '5'"),
        ({"job": 7}, "'job' must be a string"),
        ({"job": "j" * (MAX_TEXT + 1)}, "at most"),
        ({"job": "j\x00k"}, "without NUL"),
        ({"pid": [1] * (MAX_ITEMS + 1)}, "a list of 1 to"),
        ({"pid": []}, "a list of 1 to"),
        ({"pid": [True]}, "a list of integers"),
        ({"pid": ["1"]}, "a list of integers"),
        ({"all": "yes"}, "true or false"),
        ({"job": "j", "history_start": 1.5}, "an integer"),
        ({"job": "j", "history_start": True}, "an integer"),
        ({"job": "j", "timeout": "10"}, "a finite number"),
        ({"job": "j", "timeout": float("inf")}, "a finite number"),
        ({"job": "j", "timeout": 1e300}, "a timeout of"),
        ({"pid": [-1]}, "a process id is 1-"),
        ({"job": {"nested": ["x" * 10] * 10}}, "must be a string"),
    ],
)
def test_a_hostile_memory_document_is_refused_as_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        MemoryRequest.from_json(doc)
    assert said in refused.value.message


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"job": "j", "budget": ["40G"]}, "'budget' must be a string"),
        ({"job": "j", "budget": "40G", "history_start": 5}, "unknown option 'history_start'"),
        ({"job": "j", "save": "9" * 4000}, "--budget/--save"),
    ],
)
def test_a_hostile_plan_document_is_refused_as_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        MemoryPlanRequest.from_json(doc)
    assert said in refused.value.message


def test_a_budget_is_bytes_or_a_fraction_of_the_peak():
    assert parse_budget("60%") == (None, 0.6)
    assert parse_budget("1K")[0] == 1024


@pytest.mark.parametrize(
    "collector",
    [lambda r: collect(MemoryRequest(pids=r)), lambda r: collect_plan(MemoryPlanRequest(pids=r, budget="50%"))],
)
def test_a_process_that_is_gone_is_named_by_its_pid(collector):
    # GIVEN a pid no process has (the highest one Linux can give, and nothing runs there)
    pid = 2**22
    assert not os.path.exists(f"/proc/{pid}")
    # WHEN its memory is asked for THEN the error names it
    with pytest.raises(errors.DynprofError) as gone:
        collector((pid,))
    assert str(pid) in gone.value.message


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("\u0664\u0660G", "cannot read size"),  # Arabic-Indic 40G: float() and int() read it as 40
        ("\u0664\u0660%", "not a percentage (ASCII digits)"),
        ("1_0%", "not a percentage (ASCII digits)"),
        ("nan%", "between 0 and 100"),
    ],
)
def test_a_budget_takes_ascii_digits_only(text, said):
    # GIVEN a budget written with another script's digits WHEN the request is made THEN refused
    with pytest.raises(errors.UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
        MemoryPlanRequest(pids=(1,), budget=text)
