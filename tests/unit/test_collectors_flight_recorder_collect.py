"""The nccl kind's request: checked when made, and the same request whichever way it comes (the
CLI's options on this node, or the sidecar's ``nccl`` action that the job-wide path and the watch
send to every node)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from collectors.flight_recorder.collect import NcclRequest
from dynprof import errors
from dynprof.cli.nccl import NcclCommand, request_from_args
from dynprof.sidecar.actions import ACTIONS
from tests.unit._action_flags import read_options


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "exactly one of --pid, --job or --all"),
        ({"job": "j", "all": True}, "exactly one of --pid, --job or --all"),
        ({"job": "j", "timeout": 0.0}, "a timeout of 0 s"),
        ({"job": "j", "timeout": 10.0**6}, "at most 86400"),
        ({"pids": (0,)}, "a process id is 1-"),
        ({"pids": (2**23,)}, "a process id is 1-"),
        ({"pids": (5,), "skip": (6,)}, "skip goes with a job or all"),
        ({"job": "j", "skip": (0,)}, "a process id to skip is 1-"),
        ({"job": "j", "skip": (True,)}, "a process id to skip is 1-"),
    ],
)
def test_a_request_that_cannot_be_run_is_refused_when_made(kwargs, said):
    # WHEN a request names no target, two, or a bound out of range
    with pytest.raises(errors.UsageError) as refused:
        NcclRequest(**kwargs)
    # THEN it is a usage error that says which
    assert said in refused.value.message


@pytest.mark.parametrize(
    "request_",
    [
        NcclRequest(job="j1"),
        NcclRequest(pids=(11, 12), only_active=True, timeout=3.5),
        NcclRequest(all=True, stack_traces=False),
        NcclRequest(job="j2", skip=(31, 32)),
    ],
)
def test_the_action_options_of_a_request_are_the_same_request_on_the_node(request_):
    # GIVEN a request as the job-wide path and the watch send it to each node
    options = request_.options()

    # WHEN a node's sidecar turns them into the command's arguments and the command reads them
    on_the_node = request_from_args(read_options("nccl", NcclCommand(), options))

    # THEN every option is one the action takes, and the node runs exactly the same request
    assert set(options) <= set(ACTIONS["nccl"].options)
    assert on_the_node == request_


@pytest.mark.parametrize(
    "request_",
    [
        NcclRequest(job="j1"),
        NcclRequest(pids=(3, 4), only_active=True, stack_traces=False, timeout=2.5),
        NcclRequest(all=True, skip=(9,)),
    ],
)
def test_a_request_reads_back_from_its_json(request_):
    assert NcclRequest.from_json(request_.to_json()) == request_


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"job": "j", "output_path": "/tmp/x"}, "unknown option 'output_path'"),
        ({"pid": "12"}, "a list of integers"),
        ({"pid": [12, 2**40]}, "a process id is 1-"),
        ({"job": "j", "timeout": True}, "a finite number"),
        ({"job": "j", "only_active": "no"}, "true or false"),
        (None, "must be a JSON object"),
    ],
)
def test_a_hostile_document_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        NcclRequest.from_json(doc)
    assert said in refused.value.message


# -- the answer's codec ---------------------------------------------------------------------------
def test_an_answer_is_written_and_read_back_by_its_own_codec():
    from collectors.flight_recorder.collect import Collected

    got = Collected({"groups": []}, "/s/a", "j/h/node/nccl/x", 1.23456, ranks=[0, 1], notes=["rank 1 by pipe"])
    doc = got.to_json()
    assert doc == {
        "artifact": "/s/a",
        "artifact_id": "j/h/node/nccl/x",
        "elapsed_s": 1.235,
        "analysis": {"groups": []},
        "notes": ["rank 1 by pipe"],
    }
    assert (got.exit_code, got.messages) == (0, []) and Collected(None, None, None, 0.0, partial=True).exit_code == 1
    back = Collected.from_json(doc)
    assert (back.analysis, back.artifact, back.artifact_id, back.elapsed_s, back.notes) == (
        {"groups": []},
        "/s/a",
        "j/h/node/nccl/x",
        1.235,
        ["rank 1 by pipe"],
    )


def test_a_hostile_answer_reads_as_empty_fields_and_bounded_notes():
    from collectors.flight_recorder.collect import MAX_NOTE_CHARS, Collected

    back = Collected.from_json({"analysis": [1], "artifact": 7, "elapsed_s": True, "notes": ["x" * 5000, 3]})
    assert (back.analysis, back.artifact, back.artifact_id, back.elapsed_s) == (None, None, None, 0.0)
    assert back.notes == ["x" * MAX_NOTE_CHARS, "3"]
    assert Collected.from_json("not an object").notes == []


# -- the processes asked ----------------------------------------------------------------------------
def _records(*pids: int) -> list[Any]:
    return [SimpleNamespace(pid=p, job_id="j", rank=i, is_alive=lambda: True) for i, p in enumerate(pids)]


def test_the_processes_to_skip_are_left_out_of_the_jobs(monkeypatch):
    from collectors.flight_recorder import collect as kind

    monkeypatch.setattr(kind, "resolve", lambda job=None: _records(11, 12, 13))
    assert [pid for pid, _ in kind._targets(NcclRequest(job="j", skip=(12, 99)))] == [11, 13]


def test_a_job_whose_every_process_is_skipped_asks_none_and_says_so(monkeypatch):
    from collectors.flight_recorder import collect as kind

    monkeypatch.setattr(kind, "resolve", lambda job=None: _records(11, 12))
    with pytest.raises(errors.DynprofError) as refused:
        kind._targets(NcclRequest(job="j", skip=(11, 12)))
    assert refused.value.message == "every process of job 'j' here was to be skipped (11, 12): no recorder was asked"
