"""The trace kind's request: read from the ``start`` action's JSON without trusting it, and the
same request whichever way it comes (the CLI's options, or the sidecar's ``start`` action)."""

from __future__ import annotations

import json

import pytest

from collectors.torch_trace.collect import Started, TraceRequest
from dynprof import errors
from dynprof.cli.start import StartCommand, request_from_args
from tests.support.records import agent_record
from tests.unit._action_flags import read_options


@pytest.mark.parametrize(
    "options",
    [
        {"job": "j1", "timeout": 60.0},
        {"pid": [5, 6], "steps": 3, "at_step": 100, "record_shapes": True, "activities": ["cpu", "cuda"]},
        {"all": True, "duration": 2.5, "max_duration": 30.0, "no_wait": True, "with_stack": True},
        {"job": "j", "steps": 1, "sample_keep": 4, "keep_groups": ["sample-0123456789ab"], "with_flops": True},
        {"job": "j", "activities": ["CPU,cuda"], "profile_memory": True, "with_modules": True},
    ],
)
def test_the_start_action_s_options_are_the_request_both_ways(options):
    # WHEN a node's sidecar turns the action's options into the command's arguments, or reads them as JSON
    from_cli = request_from_args(read_options("start", StartCommand(), options))
    from_json = TraceRequest.from_json(options)
    # THEN the kind is asked the same, and the request writes itself back as options of that request
    assert from_json == from_cli
    assert TraceRequest.from_json(from_json.to_json()) == from_json


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"job": "j", "steps": 0}, "'steps' must be more than 0"),
        ({"job": "j", "duration": -1}, "'duration' must be more than 0"),
        ({"job": "j", "sample_keep": 0}, "'sample_keep' must be more than 0"),
        ({"job": "j", "steps": 10**12}, "--steps is 1.."),
        ({"job": "j", "steps": 2, "duration": 1.0}, "not both"),
        ({"job": "j", "activities": ["gpu"]}, "unknown activity 'gpu'"),
        ({"job": "j", "keep_groups": ["../../etc"]}, "--keep-groups"),
        ({"job": "j", "keep_groups": ["sample-0123456789ab"] * 65}, "--keep-groups"),
        ({"job": "j", "output_path": "/tmp/t"}, "unknown option 'output_path'"),
        ({"job": "j", "group_id": "g"}, "unknown option 'group_id'"),
        ({"job": "j", "timeout": 0}, "a timeout of 0 s"),
        ({"job": "j", "steps": "5"}, "an integer"),
        ({"pid": [1], "job": "j"}, "exactly one of --pid, --job or --all"),
        ("start", "must be a JSON object"),
    ],
)
def test_a_hostile_document_is_a_usage_error(doc, said):
    with pytest.raises(errors.UsageError) as refused:
        TraceRequest.from_json(doc)
    assert said in refused.value.message


# -- following a trace to its end ----------------------------------------------------------------
def _state(state: str, group: str = "g1", **fields):
    from types import SimpleNamespace

    base = {
        "state": state, "group_id": group, "start_step": 5, "steps_done": 0, "active_since": 0.0,
        "ending_since": 0.0, "profiled_s": 0.0, "last_artifact": "", "last_artifact_status": "", "last_error": "",
    }  # fmt: skip
    return SimpleNamespace(step=5, trace=SimpleNamespace(**{**base, **fields}))


class _Scripted:
    """An agent's answers to status, one per look (the last repeated); an exception is raised."""

    def __init__(self, answers):
        self.answers = list(answers)

    def status(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class _Lines:
    def __init__(self):
        self.lines = []

    def update(self, text):
        self.lines.append(text)

    def done(self):
        pass


def _record(pid: int, job: str | None = "j1"):
    return agent_record(pid, rank=0, world_size=1, job_id=job, socket="/s", log="/l")


@pytest.fixture
def fast(monkeypatch):
    from collectors.torch_trace import collect

    monkeypatch.setattr(collect, "POLL_S", 0.0)
    monkeypatch.setattr(collect, "parallel", lambda fn, items: [_try(fn, i) for i in items])
    return collect


def _try(fn, item):
    try:
        return fn(item)
    except Exception as exc:
        return exc


def _wait(collect, client, record, progress):
    request = TraceRequest(pids=(record.pid,), steps=10)
    return collect._wait_done(request, [client], [record], "g1", 10, 5, progress)[0]


def test_an_agent_silent_while_it_writes_the_trace_is_waited_for_not_lost(fast):
    import os

    # GIVEN a live process whose agent traced 10/10 steps, then did not answer while it wrote
    # the trace, then answered with the trace written
    silent = errors.Timeout("the agent of process 1 did not answer within 5 s")
    done = _state("idle", last_artifact="/store/t", last_artifact_status="complete")
    client = _Scripted([_state("tracing", steps_done=10, active_since=1.0), silent, silent, silent, done])
    progress = _Lines()
    # WHEN the start follows it
    result = _wait(fast, client, _record(os.getpid()), progress)
    # THEN the trace is complete, and meanwhile it said the agent was writing it, never lost
    assert result["status"] == "complete" and result["artifact"] == "/store/t"
    assert any("ending the trace: its agent is busy writing it" in line for line in progress.lines)
    assert not any("lost" in line for line in progress.lines)


def test_an_agent_that_answers_while_writing_shows_how_long_the_write_has_run(fast):
    import os
    import time

    # GIVEN an agent writing a trace that recorded 12 s, for 3 s now
    writing = _state("exporting", steps_done=10, ending_since=time.time() - 3, profiled_s=12.0)
    done = _state("idle", last_artifact="/store/t", last_artifact_status="complete")
    progress = _Lines()
    # WHEN followed THEN the progress says so
    assert _wait(fast, _Scripted([writing, done]), _record(os.getpid()), progress)["status"] == "complete"
    assert "rank 0: writing the trace (3 s; 12 s recorded)" in progress.lines


def test_past_the_write_bound_the_trace_is_still_being_written_not_failed(fast, monkeypatch):
    import os

    from dynprof.cli.start import StartCommand

    monkeypatch.setattr(fast, "WRITE_WAIT_MIN_S", 0.0)
    monkeypatch.setattr(fast, "WRITE_WAIT_PER_PROFILED_S", 0.0)
    # GIVEN a live process whose agent stopped answering after it traced, and never answers again
    silent = errors.Timeout("the agent of process 1 did not answer within 5 s")
    client = _Scripted([_state("tracing", steps_done=10, active_since=1.0), silent])
    # WHEN the start follows it past its write bound
    result = _wait(fast, client, _record(os.getpid(), job="j 1"), _Lines())
    # THEN it is still being written, with where it will appear, and the start says so
    assert result["status"] == fast.WRITING and result["artifact"] is None and result["error"] is None
    assert "still being written" in result["note"] and "`dynprof ls --kind trace --job 'j 1'`" in result["note"]
    text = StartCommand().render(fast.Started(exit_code=9, results=[result]))
    assert text.startswith("rank 0 (pid ") and "still being written" in text and "failed" not in text


def test_a_process_that_is_gone_is_lost_contact(fast, monkeypatch):
    # GIVEN a process that exited without writing a trace (no such pid, nothing in the store)
    monkeypatch.setattr(fast, "result_from_store", lambda *a: None)
    monkeypatch.setattr(fast, "_alive", lambda pid: False)
    client = _Scripted([errors.Timeout("the agent of process 1 did not answer within 5 s")])
    # WHEN followed THEN it failed: contact lost
    result = _wait(fast, client, _record(4_194_303), _Lines())
    assert result["status"] == "failed" and "lost contact" in result["error"]
    assert "(it has exited)" in result["error"]


def test_a_live_process_whose_agent_broke_the_connection_is_said_to_still_run(fast, monkeypatch):
    # GIVEN a process that runs on, whose agent hung up without an answer
    monkeypatch.setattr(fast, "result_from_store", lambda *a: None)
    monkeypatch.setattr(fast, "_alive", lambda pid: True)
    client = _Scripted([errors.AgentError("the agent of process 1 broke the connection: [Errno 104] reset")])
    # WHEN followed THEN it failed, and the error says the process still runs (not that it died)
    result = _wait(fast, client, _record(4_194_303), _Lines())
    assert result["status"] == "failed" and "lost contact" in result["error"]
    assert "(it still runs)" in result["error"] and "broke the connection" in result["error"]


@pytest.mark.parametrize(
    ("last", "bound"),
    [
        (None, 60.0),
        (_state("exporting", profiled_s=100.0).trace, 360.0),
        (_state("exporting", profiled_s=10_000.0).trace, 3600.0),
    ],
)
def test_the_write_bound_grows_with_how_long_the_trace_recorded(last, bound):
    from collectors.torch_trace.collect import write_wait_s

    assert write_wait_s(last) == bound


@pytest.mark.parametrize("seen_first", [True, False])
def test_a_trace_that_ended_before_another_clients_began_is_found_in_the_store(fast, monkeypatch, seen_first):
    import os

    # GIVEN a trace (group g1) that ended between two polls while another client's (g2) began,
    # so the agent answers only for g2; g1's artifact is in the store
    monkeypatch.setattr(
        fast,
        "result_from_store",
        lambda record, group, at: (
            {"pid": record.pid, "status": "complete", "artifact": f"/store/{group}"} if group == "g1" else None
        ),
    )
    other = _state("tracing", group="g2", steps_done=1)
    answers = [_state("tracing", steps_done=3), other] if seen_first else [other]
    # WHEN the start follows g1 (the stress program's clients hung here, with no bound)
    result = _wait(fast, _Scripted(answers), _record(os.getpid()), _Lines())
    # THEN it is answered from the store
    assert result == {"pid": os.getpid(), "status": "complete", "artifact": "/store/g1"}


def test_a_trace_that_left_nothing_before_another_began_fails_saying_so(fast, monkeypatch):
    import os

    monkeypatch.setattr(fast, "result_from_store", lambda *a: None)
    result = _wait(fast, _Scripted([_state("idle", group="g2")]), _record(os.getpid()), _Lines())
    assert result["status"] == "failed" and "went on to another trace (group g2)" in result["error"]


TARGET = {"pid": 7, "rank": 0, "job": "j", "start_step": 5}
WRITTEN = {**TARGET, "status": "complete", "artifact": "/s/t", "error": None}


@pytest.mark.parametrize(
    "doc",
    [
        {"group_id": "g1", "at_step": 5, "state": "armed", "targets": [TARGET]},  # --no-wait
        {"group_id": "g1", "at_step": None, "state": "armed", "targets": []},
        {"group_id": "g1", "state": "tracing", "targets": [TARGET]},  # open-ended, active
        {"group_id": "g1", "state": "ended", "targets": [], "results": [WRITTEN]},
        {"group_id": "g1", "results": [WRITTEN]},  # steps or duration, waited for
    ],
)
def test_a_starts_answer_reads_back_what_it_wrote_key_for_key(doc):
    back = Started.from_json(json.loads(json.dumps(doc)))
    assert json.dumps(back.to_json()) == json.dumps(doc)


@pytest.mark.parametrize("doc", [None, "x", [], {"group_id": "g1"}, {"targets": {}, "results": "x"}])
def test_a_starts_answer_without_targets_or_results_is_refused(doc):
    with pytest.raises(errors.ArtifactError, match="start answer"):
        Started.from_json(doc)


def test_a_starts_fields_of_another_type_are_left_out():
    got = Started.from_json({"group_id": 7, "state": ["x"], "at_step": True, "targets": [TARGET, 3], "results": "x"})
    assert (got.group_id, got.state, got.at_step, got.targets, got.results) == (None, None, None, [TARGET], None)


def test_the_rows_a_job_wide_start_merges_are_the_traces_written_else_the_targets():
    both = Started(group_id="g", state="ended", targets=[TARGET], results=[WRITTEN])
    assert both.rank_rows() == [WRITTEN] and both.artifact_paths() == ["/s/t"]
    armed = Started(group_id="g", state="armed", targets=[TARGET])
    assert armed.rank_rows() == [TARGET] and armed.artifact_paths() == []
