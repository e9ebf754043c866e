"""dynprof.node_requests: the requests of `dynprof ps`, `ls` and `stop`, checked when made, read
from JSON without trusting it, and the same request whichever way it comes (the CLI's options,
or the sidecar's ``ps``, ``ls`` and ``stop`` actions), refused in the words of the command's
own parser."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from dynprof import errors
from dynprof.arguments import MAX_PID
from dynprof.cli.ls import LsCommand
from dynprof.cli.ls import request_from_args as ls_from_args
from dynprof.cli.ps import PsCommand
from dynprof.cli.ps import request_from_args as ps_from_args
from dynprof.cli.stop import StopCommand
from dynprof.cli.stop import request_from_args as stop_from_args
from dynprof.node_requests import MAX_LIMIT, LsRequest, PsRequest, StopRequest
from dynprof.requests import MAX_ITEMS, MAX_TEXT
from dynprof.sidecar.actions import check_options, run_action
from tests.unit import _action_flags as af

COMMANDS: dict[str, Any] = {"ps": PsCommand, "ls": LsCommand, "stop": StopCommand}
FROM_ARGS: dict[str, Any] = {"ps": ps_from_args, "ls": ls_from_args, "stop": stop_from_args}
REQUESTS: dict[str, Any] = {"ps": PsRequest, "ls": LsRequest, "stop": StopRequest}


def _parsed(name: str, options: dict[str, Any]) -> argparse.Namespace:
    """The command's own parser given the arguments the action's options become."""
    return af.parse_options(name, COMMANDS[name](), check_options(name, options).options, None, None)


def _parser_refusal(name: str, options: dict[str, Any]) -> errors.UsageError:
    with pytest.raises(errors.UsageError) as refused:
        _parsed(name, options)
    return refused.value


# -- checked when made ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_type", "kwargs", "said"),
    [
        (PsRequest, {"timeout": 0.0}, "a timeout of 0 s"),
        (PsRequest, {"timeout": 1e9}, "at most 86400"),
        (LsRequest, {"limit": -1}, "ls: argument --limit: -1 is out of range (0..1000000000)"),
        (LsRequest, {"limit": MAX_LIMIT + 1}, "is out of range"),
        (LsRequest, {"limit": 10**400}, "ls: argument --limit: "),
        (LsRequest, {"limit": True}, "an integer"),
        (StopRequest, {}, "one of the arguments --pid --job --all is required"),
        (StopRequest, {"all": False}, "one of the arguments --pid --job --all is required"),
        (StopRequest, {"pids": (1,), "job": "j"}, "argument --job: not allowed with argument --pid"),
        (StopRequest, {"job": "j", "all": True}, "argument --all: not allowed with argument --job"),
        (StopRequest, {"pids": (0,)}, "stop: argument --pid: 0 is not a valid pid"),
        (StopRequest, {"pids": (MAX_PID + 1,)}, "is not a valid pid"),
        (StopRequest, {"pids": (10**400,)}, "stop: argument --pid: "),
        (StopRequest, {"pids": (True,)}, "a process id is an integer"),
        (StopRequest, {"all": True, "timeout": -1.0}, "a timeout of -1 s"),
    ],
)
def test_a_request_that_cannot_be_run_is_refused_when_made(request_type, kwargs, said):
    with pytest.raises(errors.UsageError) as refused:
        request_type(**kwargs)
    assert said in refused.value.message


def test_a_stop_of_a_job_named_empty_is_a_request_as_the_parser_takes_it():
    # the parser takes `--job=` as naming a job (the empty one): so does the request
    assert _parsed("stop", {"job": ""}).job == ""
    assert StopRequest.from_json({"job": ""}) == StopRequest(job="")
    assert StopRequest(job="").to_json() == {"timeout": 120.0, "job": ""}


# -- the same request either way -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("ps", {}, PsRequest()),
        ("ps", {"job": "j1", "timeout": 2.5}, PsRequest(job="j1", timeout=2.5)),
        ("ls", {}, LsRequest()),
        ("ls", {"job": "j", "kind": "trace", "limit": 3, "all": True}, LsRequest("j", "trace", 3, True)),
        ("ls", {"all": False, "limit": 0}, LsRequest()),
        ("stop", {"all": True}, StopRequest(all=True)),
        ("stop", {"pid": [7, 8], "no_wait": True}, StopRequest(pids=(7, 8), no_wait=True)),
        ("stop", {"job": "j", "timeout": 5}, StopRequest(job="j", timeout=5.0)),
        ("stop", {"pid": 9}, StopRequest(pids=(9,))),
    ],
)
def test_the_actions_options_are_the_request_both_ways(name, options, expected):
    # WHEN the options are the command's arguments, or are read as JSON
    from_cli = FROM_ARGS[name](_parsed(name, options))
    from_json = REQUESTS[name].from_json(options)
    # THEN the command is asked exactly that, and the request writes itself back as the same options
    assert from_cli == from_json == expected
    assert REQUESTS[name].from_json(expected.to_json()) == expected
    assert json.loads(json.dumps(expected.to_json())) == expected.to_json()


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("ls", {"limit": -3}),
        ("ls", {"limit": MAX_LIMIT + 1}),
        ("ls", {"limit": 10**50}),
        ("stop", {}),
        ("stop", {"all": False}),
        ("stop", {"pid": [1], "job": "j"}),
        ("stop", {"job": "j", "pid": [1]}),
        ("stop", {"all": True, "job": "j"}),
        ("stop", {"job": "j", "all": True, "pid": [2]}),
        ("stop", {"pid": [0]}),
        ("stop", {"pid": [5, -1, 2**30]}),
        ("stop", {"pid": [10**50]}),
    ],
)
def test_a_value_the_parser_refuses_is_refused_by_the_request_in_its_words(name, options):
    # GIVEN a value the command's parser refuses (a usage error of the command)
    said = _parser_refusal(name, options)
    # WHEN the request reads it THEN it is refused the same way: the same message, help and code
    with pytest.raises(errors.UsageError) as refused:
        REQUESTS[name].from_json(options)
    got = refused.value
    assert (got.message, got.help, got.exit_code) == (said.message, said.help, said.exit_code)


# -- hostile documents ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "doc", "said"),
    [
        ("ps", [], "ps: the options must be a JSON object"),
        ("ls", "limit=3", "ls: the options must be a JSON object"),
        ("stop", None, "stop: the options must be a JSON object"),
        ("ps", {"output": "/etc/passwd"}, "unknown option 'output'"),
        ("ps", {"hosts": ["node-1"]}, "unknown option 'hosts'"),
        ("ls", {"attach": True}, "unknown option 'attach'"),
        ("stop", {"all": True, "attach": True}, "unknown option 'attach'"),
        ("stop", {"all": True, 5: 1}, "unknown option '5'"),
        ("ps", {"job": 7}, "'job' must be a string"),
        ("ps", {"job": {"nested": ["x" * 10] * 10}}, "'job' must be a string"),
        ("ps", {"job": "j" * (MAX_TEXT + 1)}, "at most"),
        ("ls", {"kind": "trace\x00"}, "without NUL"),
        ("ps", {"timeout": "10"}, "a finite number"),
        ("ps", {"timeout": float("inf")}, "a finite number"),
        ("ps", {"timeout": float("nan")}, "a finite number"),
        ("ps", {"timeout": True}, "a finite number"),
        ("ps", {"timeout": 0}, "a timeout of 0 s"),
        ("ls", {"limit": 1.5}, "an integer"),
        ("ls", {"limit": "3"}, "an integer"),
        ("ls", {"limit": False}, "an integer"),
        ("ls", {"all": "yes"}, "true or false"),
        ("stop", {"pid": [1] * (MAX_ITEMS + 1)}, "a list of 1 to"),
        ("stop", {"pid": []}, "a list of 1 to"),
        ("stop", {"pid": [True]}, "a list of integers"),
        ("stop", {"pid": ["1"]}, "a list of integers"),
        ("stop", {"pid": [1.0]}, "a list of integers"),
        ("stop", {"all": 1}, "true or false"),
        ("stop", {"all": True, "no_wait": "no"}, "true or false"),
        ("stop", {"all": True, "timeout": -5}, "a timeout of -5 s"),
        ("stop", {"all": True, "timeout": 1e300}, "a timeout of"),
    ],
)
def test_a_hostile_document_is_refused_as_a_usage_error(name, doc, said):
    with pytest.raises(errors.UsageError) as refused:
        REQUESTS[name].from_json(doc)
    assert said in refused.value.message and refused.value.exit_code == 2


# -- through the sidecar's action, with the real commands --------------------------------------------
def test_the_actions_are_read_as_requests_with_no_argv(dynprof_dirs, monkeypatch):
    # GIVEN the real rows, and no argument parser that may be reached meanwhile
    asked: list[object] = []

    def refuse_parse(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        asked.append(args)
        raise AssertionError("parsed argv")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", refuse_parse)
    # WHEN each action runs on this node
    ps = run_action("ps", {"job": "j"})
    ls = run_action("ls", {"limit": 1})
    stop = run_action("stop", {"all": True})
    # THEN each answered from its request, as the CLI would here (no agent, an empty store)
    assert asked == []
    assert ps["exit_code"] == 0 and ps["result"] == {"agents": []}, ps
    assert ls["exit_code"] == 0 and ls["result"]["artifacts"] == [] and ls["messages"] == [], ls
    assert stop["exit_code"] == 5 and stop["error"]["type"] == "NoAgent", stop


def test_a_refused_value_is_the_commands_usage_error_as_before():
    # GIVEN the real rows WHEN the actions get values their commands refuse
    ls = run_action("ls", {"limit": -3})
    stop = run_action("stop", {"job": "j", "all": True})
    # THEN each is a usage error (2), in the words of the command's parser, with its help
    for answer, message in (
        (ls, "ls: argument --limit: -3 is out of range (0..1000000000)"),
        (stop, "stop: argument --all: not allowed with argument --job"),
    ):
        assert answer["exit_code"] == 2 and answer["error"]["type"] == "UsageError", answer
        assert answer["error"]["message"] == message and answer["result"] == {"error": answer["error"]}
        assert answer["messages"] == [f"dynprof: error: {message}", f"  what to do: {answer['error']['help']}"]
