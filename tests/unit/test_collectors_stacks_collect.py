"""The stacks kind's request: checked when made, and the same request whichever way it comes
(the CLI's options, or the sidecar's ``stacks`` action)."""

from __future__ import annotations

import argparse
import os

import pytest

from collectors.stacks.collect import StacksRequest, collect
from dynprof import errors
from dynprof.cli.stacks import StacksCommand, request_from_args
from dynprof.sidecar.actions import argv_for


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    StacksCommand().prepare_parser(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "exactly one of --pid, --job, --all or --core"),
        ({"job": "j", "core": "core.1"}, "exactly one of --pid, --job, --all or --core"),
        ({"job": "j", "executable": "/usr/bin/python3"}, "--executable goes with --core"),
        ({"job": "j", "method": "gdb"}, "unknown method 'gdb'"),
        ({"job": "j", "timeout": -1.0}, "a timeout of -1 s"),
        ({"pids": (-5,)}, "a process id is 1-"),
    ],
)
def test_a_request_that_cannot_be_run_is_refused_when_made(kwargs, said):
    # WHEN a request names no target, two, or a value out of range
    with pytest.raises(errors.UsageError) as refused:
        StacksRequest(**kwargs)
    # THEN it is a usage error that says which
    assert said in refused.value.message


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"job": "j1"}, StacksRequest(job="j1")),
        (
            {"pid": [7, 8], "native": True, "method": "pystack", "timeout": 4.0, "no_save": True},
            StacksRequest(pids=(7, 8), native=True, method="pystack", timeout=4.0, save=False),
        ),
        ({"all": True, "locals": True}, StacksRequest(all=True, locals=True)),
    ],
)
def test_the_sidecar_s_stacks_action_becomes_the_request_its_options_say(options, expected):
    # WHEN a node's sidecar turns an action's options into the command's arguments
    request = request_from_args(_parse(argv_for("stacks", options)[1:]))
    # THEN the kind is asked exactly that
    assert request == expected


def test_a_process_that_is_gone_is_named_by_its_pid():
    # GIVEN a pid no process has (the highest one Linux can give, and nothing runs there)
    pid = 2**22
    assert not os.path.exists(f"/proc/{pid}")
    # WHEN its stacks are asked for
    with pytest.raises(errors.ProcessNotFound) as gone:
        collect(StacksRequest(pids=(pid,), save=False))
    # THEN the error names it
    assert str(pid) in gone.value.message
