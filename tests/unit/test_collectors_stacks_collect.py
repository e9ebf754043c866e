"""The stacks kind's request: checked when made, and the same request whichever way it comes
(the CLI's options, or the sidecar's ``stacks`` action)."""

from __future__ import annotations

import os

import pytest

from collectors.stacks.collect import StacksRequest, collect
from dynprof import errors
from dynprof.cli.stacks import StacksCommand, request_from_args
from tests.unit._action_flags import read_options


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
    request = request_from_args(read_options("stacks", StacksCommand(), options))
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


@pytest.mark.parametrize(
    "request_",
    [
        StacksRequest(job="j1"),
        StacksRequest(pids=(7, 8), native=True, locals=True, method="py-spy", timeout=3.0, save=False),
    ],
)
def test_a_request_reads_back_from_its_json(request_):
    assert StacksRequest.from_json(request_.to_json()) == request_


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"core": "/etc/shadow"}, "unknown option 'core'"),
        ({"job": "j", "executable": "/bin/sh"}, "unknown option 'executable'"),
        ({"job": ["j"]}, "'job' must be a string"),
        ({"job": "j", "method": "x" * 5000}, "at most 4096 characters"),
        ({"pid": [1] * 2000}, "a list of 1 to"),
        ({"job": "j", "timeout": -2}, "a timeout of -2 s"),
        ({"job": "j", "native": 1}, "true or false"),
        (["job", "j"], "must be a JSON object"),
    ],
)
def test_a_hostile_document_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        StacksRequest.from_json(doc)
    assert said in refused.value.message


def test_a_core_files_request_is_not_sent_as_json():
    with pytest.raises(errors.UsageError, match="core file"):
        StacksRequest(core="core.1").to_json()


# -- the answer's codec ---------------------------------------------------------------------------
def test_a_nodes_answer_is_written_and_read_back_by_its_own_codec():
    from collectors.stacks.collect import Collected
    from collectors.stacks.model import Stacks

    got = Collected(Stacks([], failures={"pid 7": "gone"}), 0.12345, "/s/stacks")
    doc = got.to_json()
    assert doc["artifact"] == "/s/stacks" and doc["elapsed_s"] == 0.123 and doc["failures"] == {"pid 7": "gone"}
    assert (got.exit_code, got.messages) == (1, [])
    back = Collected.from_json(doc)
    assert back.artifact == "/s/stacks" and back.elapsed_s == 0.123 and back.stacks.failures == {"pid 7": "gone"}
    odd = Collected.from_json({**doc, "artifact": 3, "elapsed_s": "x"})
    assert odd.artifact is None and odd.elapsed_s == 0.0
