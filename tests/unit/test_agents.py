"""dynprof.agents: this node's agents asked at once, their rows for `dynprof ps`, and which of
them a --pid / --job / --all request targets."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from dynprof import agents, errors
from dynprof.agents import agent_rows, parallel, refresh_records, resolve, select_workers
from dynprof.proto import pb
from dynprof.registry import write_record
from tests.support.records import agent_record


def _record(pid: int, rank: int | None = None, job: str | None = "j", ppid: int = 1, role: str | None = None):
    return agent_record(
        pid, ppid=ppid, rank=rank, job_id=job, cmdline=["python", "train.py"], socket="/nonexistent.sock", role=role
    )


def _status(rank: int = -1, world_size: int = -1, job: str = "", role: str = "", **more: Any) -> pb.Status:
    status = pb.Status(rank=rank, world_size=world_size, job_id=job, role=role, **more)
    status.trace.state = "idle"
    return status


@pytest.fixture
def answers(monkeypatch):
    """``answers[pid] = Status or exception``: what each agent answers when asked."""
    table: dict[int, Any] = {}

    class FakeClient:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def status(self) -> Any:
            found = table.get(self.pid, errors.NoAgent(f"process {self.pid} has no listening dynprof agent"))
            if isinstance(found, Exception):
                raise found
            return found

    monkeypatch.setattr(agents.AgentClient, "for_record", classmethod(lambda cls, r, timeout=5.0: FakeClient(r.pid)))
    return table


def test_parallel_keeps_the_order_and_returns_exceptions_as_values():
    # GIVEN a function that fails on one item
    def fn(x: int) -> int:
        if x == 2:
            raise ValueError("two")
        return x * 10

    # WHEN it runs over the items
    found = parallel(fn, [1, 2, 3])
    # THEN each result is at its item's place, the failure as the exception
    assert found[0] == 10 and found[2] == 30
    assert isinstance(found[1], ValueError) and str(found[1]) == "two"
    assert parallel(fn, []) == []


def test_parallel_asks_at_most_max_workers_at_once():
    # GIVEN a function that records how many run at the same time
    lock = threading.Lock()
    running = [0]
    most = [0]
    gate = threading.Barrier(2, timeout=5)

    def fn(x: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if x < 2:
            gate.wait()  # the first two meet: two do run at once
        with lock:
            running[0] -= 1
        return x

    # WHEN eight items run with two workers
    assert parallel(fn, range(8), max_workers=2) == list(range(8))
    # THEN never more than two ran at once
    assert most[0] == 2


def test_refresh_records_takes_rank_job_and_role_from_live_agents(answers):
    # GIVEN one record whose agent now knows its rank, and one whose agent does not answer
    spawned = _record(101, rank=None, job="old")
    gone = _record(102, rank=7, job="kept")
    answers[101] = _status(rank=3, world_size=8, job="new", role="trainer")
    answers[102] = errors.Timeout("no answer")
    # WHEN they are refreshed
    refresh_records([spawned, gone])
    # THEN the answering one is up to date, the other keeps what its record says
    assert (spawned.rank, spawned.world_size, spawned.job_id, spawned.role) == (3, 8, "new", "trainer")
    assert (gone.rank, gone.job_id) == (7, "kept")


def test_refresh_records_reads_minus_one_and_empty_as_unknown_and_ignores_unknown_roles(answers):
    record = _record(101, rank=2, job="j", role="launcher")
    answers[101] = _status(rank=-1, world_size=-1, job="", role="emperor")
    refresh_records([record])
    assert (record.rank, record.world_size, record.job_id) == (None, None, None)
    assert record.role == "launcher", "a role the protocol does not know must not replace the record's"


def test_agent_rows_say_unresponsive_for_a_timeout_and_error_for_anything_else(answers):
    # GIVEN three agents: one answers, one times out, one fails
    records = [_record(101, rank=0), _record(102, rank=1), _record(103, rank=2)]
    answers[101] = _status(rank=0, world_size=3, job="j", role="trainer", step=12, step_time_s=0.25, phase="eval")
    answers[102] = errors.Timeout("the agent of process 102 did not answer within 1 s")
    answers[103] = errors.AgentError("the agent of process 103 broke the connection")
    # WHEN the rows are made
    rows = {row["pid"]: row for row in agent_rows(records, timeout=1.0)}
    # THEN the live one carries its status, the others their state and error
    assert rows[101]["state"] == "idle" and rows[101]["step"] == 12
    assert rows[101]["step_time_ms"] == 250.0 and rows[101]["phase"] == "eval"
    assert rows[101]["world_size"] == 3 and rows[101]["job"] == "j"
    assert rows[102]["state"] == "unresponsive" and "did not answer" in rows[102]["error"]
    assert rows[103]["state"] == "error" and "broke the connection" in rows[103]["error"]
    assert rows[102]["step"] is None and rows[103]["step"] is None


def test_agent_rows_unknown_step_time_and_phase_are_none(answers):
    answers[101] = _status(rank=0, role="trainer")
    (row,) = agent_rows([_record(101, rank=0)], timeout=1.0)
    assert row["step_time_ms"] is None and row["phase"] is None and row["phase_since"] is None
    assert row["rank"] == 0 and row["role"] == "trainer"


def test_select_workers_orders_by_job_then_rank_then_pid():
    # GIVEN trainers of two jobs listed in no order
    records = [
        _record(30, rank=1, job="b", role="trainer"),
        _record(20, rank=0, job="b", role="trainer"),
        _record(12, rank=1, job="a", role="trainer"),
        _record(11, rank=0, job="a", role="trainer"),
    ]
    # WHEN / THEN job a's ranks come first, each job by rank
    assert [r.pid for r in select_workers(records)] == [11, 12, 20, 30]


def test_select_workers_leaves_out_launchers_and_workers_while_a_trainer_is_known():
    records = [
        _record(10, role="launcher"),
        _record(11, rank=0, ppid=10, role="trainer"),
        _record(12, rank=0, ppid=11, role="worker"),
    ]
    assert [r.pid for r in select_workers(records)] == [11]


def test_resolve_a_pid_without_an_agent_says_how_to_attach_one():
    # GIVEN this live process, which has no agent record
    pid = os.getpid()
    # WHEN it is resolved THEN NoAgent, whose help names `dynprof attach PID`
    with pytest.raises(errors.NoAgent, match=f"process {pid} has no dynprof agent") as info:
        resolve([pid])
    assert f"dynprof attach {pid}" in info.value.help


def test_resolve_a_pid_with_a_live_record_returns_it():
    write_record(_record(os.getpid(), rank=0))
    (found,) = resolve([os.getpid()])
    assert found.pid == os.getpid() and found.rank == 0


def test_resolve_with_no_agent_on_the_node_is_no_agent():
    with pytest.raises(errors.NoAgent, match="no dynprof agent is running on this node"):
        resolve()


def test_resolve_an_unknown_job_names_the_jobs_that_have_agents(answers):
    # GIVEN a live agent of job "train" (this process's pid)
    write_record(_record(os.getpid(), rank=0, job="train"))
    answers[os.getpid()] = _status(rank=0, job="train", role="trainer")
    # WHEN another job is asked for
    with pytest.raises(errors.DynprofError, match="no agent of job 'other' on this node") as info:
        resolve(job="other")
    # THEN the help lists the jobs that are here
    assert "Jobs with agents here: train" in info.value.help


def test_resolve_a_job_says_once_which_processes_it_leaves_out(answers, capsys, monkeypatch):
    monkeypatch.setattr(agents, "_SAID_LEFT_OUT", set())
    # GIVEN a launcher (our parent) and its trainer (us), both with agents of job "lo"
    me, parent = os.getpid(), os.getppid()
    write_record(_record(parent, job="lo", role="launcher"))
    write_record(_record(me, rank=0, job="lo", ppid=parent, role="trainer"))
    answers[parent] = _status(job="lo", role="launcher")
    answers[me] = _status(rank=0, job="lo", role="trainer")
    # WHEN the job is resolved twice
    assert [r.pid for r in resolve(job="lo")] == [me]
    first = capsys.readouterr().err
    assert [r.pid for r in resolve(job="lo")] == [me]
    second = capsys.readouterr().err
    # THEN the launcher left out is named, and only the first time
    assert f"pid {parent} (a launcher)" in first
    assert second == ""
