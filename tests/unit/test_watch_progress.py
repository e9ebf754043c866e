"""One read of a node's live progress (dynprof/watch/progress.py): each agent's status joined
with what the node sees of its process (state, CPU and I/O with its children's), the job's
trainers only, an agent that does not answer named by why, and the rows in rank order."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

import psutil
import pytest

from dynprof import errors
from dynprof.proto import pb
from dynprof.registry import AgentRecord
from dynprof.watch import progress
from tests.support.records import agent_record


def _record(pid: int, rank: int | None, job: str = "j", role: str | None = "trainer", ppid: int = 1) -> AgentRecord:
    return agent_record(
        pid,
        ppid=ppid,
        rank=rank,
        world_size=4,
        job_id=job,
        cmdline=["python", "train.py"],
        started_at=12.0,
        socket="",
        role=role,
    )


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


class _Clients:
    """Stands in for AgentClient.for_record: each pid answers what the test says (or raises it)."""

    def __init__(self, answers: dict[int, Any]) -> None:
        self.answers = answers
        self.asked: list[tuple[int, float]] = []

    def for_record(self, record: AgentRecord, timeout: float) -> Any:
        self.asked.append((record.pid, timeout))
        answer = self.answers[record.pid]

        def status() -> Any:
            if isinstance(answer, Exception):
                raise answer
            return answer

        return types.SimpleNamespace(status=status)


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(answers: dict[int, Any]) -> _Clients:
        fake = _Clients(answers)
        monkeypatch.setattr(progress, "AgentClient", fake)
        return fake

    return install


def test_parents_maps_this_process_to_its_parent():
    # WHEN the process table is read
    parents = progress._parents()

    # THEN this process is in it, under its own parent
    assert parents[os.getpid()] == os.getppid()


def test_io_bytes_are_reads_plus_writes_or_none_where_the_kernel_does_not_say():
    # GIVEN processes whose I/O counters have chars, lack them, or cannot be read
    with_chars = types.SimpleNamespace(io_counters=lambda: types.SimpleNamespace(read_chars=100, write_chars=23))
    without = types.SimpleNamespace(io_counters=lambda: types.SimpleNamespace(read_bytes=1, write_bytes=2))

    def denied() -> Any:
        raise psutil.AccessDenied(1)

    unreadable = types.SimpleNamespace(io_counters=denied)

    # THEN the sum, or None
    assert progress._io_bytes(with_chars) == 123  # type: ignore[arg-type]
    assert progress._io_bytes(without) is None  # type: ignore[arg-type]
    assert progress._io_bytes(unreadable) is None  # type: ignore[arg-type]


def test_a_process_counts_its_live_childrens_cpu_and_io():
    # GIVEN this process and two children, one of which can no longer be read
    me = psutil.Process()
    child = types.SimpleNamespace(
        cpu_times=lambda: types.SimpleNamespace(user=100.0, system=20.0),
        io_counters=lambda: types.SimpleNamespace(read_chars=1000, write_chars=0),
    )

    def gone() -> Any:
        raise psutil.NoSuchProcess(1)

    gone_child = types.SimpleNamespace(cpu_times=gone, io_counters=gone)
    own_cpu = sum(me.cpu_times()[:2])
    own_io = progress._io_bytes(me)  # read first: the counters only grow

    # WHEN its facts are read
    facts = progress._process_facts(os.getpid(), [child, gone_child])  # type: ignore[list-item]

    # THEN the child's 120 s and 1000 bytes are added to its own, the gone child is left out
    assert facts.state == me.status()
    assert facts.cpu_s is not None and facts.cpu_s >= own_cpu + 120.0
    if own_io is not None:  # rchar/wchar are there on Linux
        assert facts.io_bytes is not None and facts.io_bytes >= own_io + 1000
    assert facts.started == me.create_time()


def test_a_process_that_is_gone_reads_as_gone():
    # GIVEN a pid whose process has exited
    pid = _dead_pid()

    # WHEN read
    facts = progress._process_facts(pid, [])

    # THEN it is gone, with nothing else known
    assert (facts.state, facts.cpu_s, facts.io_bytes, facts.started) == ("gone", None, None, None)


def test_a_gpu_step_is_read_only_when_recorded():
    # GIVEN a status that recorded a GPU step with a probe, one that did not, and one of an older agent
    recorded = pb.Status(
        gpu_step=pb.GpuStep(
            recorded=True, step=9, done=True, age_s=2.5, device=1, device_uuid="GPU-1", probed=True, probe_age_s=1.0
        )
    )

    # WHEN read
    step = progress._gpu_step(recorded)

    # THEN only the first has one, with its fields and its probe
    assert step is not None and (step.step, step.done, step.device, step.device_uuid) == (9, True, 1, "GPU-1")
    assert (step.probe_done, step.probe_age_s) == (False, 1.0)
    assert progress._gpu_step(pb.Status(gpu_step=pb.GpuStep(recorded=False))) is None
    assert progress._gpu_step(object()) is None


def test_an_answering_agent_gives_its_steps_and_the_identity_it_says(clients):
    # GIVEN this process's record (rank unknown to the registry) and its agent's answer
    record = _record(os.getpid(), None)
    now_ish = psutil.Process().create_time() + 1
    fake = clients(
        {os.getpid(): pb.Status(step=41, step_time_s=0.25, last_step_at=now_ish, rank=3, world_size=8, job_id="j")}
    )

    # WHEN the node's progress is read
    node = progress.read_progress([record], "node-1", "j", timeout=0.7, poll_every_s=5.0)

    # THEN the row carries the steps, the rank the agent said, and the process facts
    assert fake.asked == [(os.getpid(), 0.7)], "each agent is asked once, with the read's timeout"
    assert (node.host, node.poll_every_s) == ("node-1", 5.0)
    (row,) = node.ranks
    assert (row.rank, row.world_size, row.job, row.host, row.agent) == (3, 8, "j", "node-1", "up")
    assert (row.step, row.step_time_s, row.last_step_at) == (41, 0.25, now_ish)
    assert row.last_step_age_s == pytest.approx(node.time - now_ish)
    assert row.process_state == psutil.Process().status()
    assert row.started_at == psutil.Process().create_time()


def test_an_agent_that_never_stepped_has_no_step_age(clients):
    # GIVEN an agent whose last step time is unset
    clients({os.getpid(): pb.Status(step=0, rank=0, job_id="j")})

    # WHEN read
    (row,) = progress.read_progress([_record(os.getpid(), 0)], "h").ranks

    # THEN there is no last step (0: none yet) and no age
    assert row.last_step_at == 0.0 and row.last_step_age_s is None


def test_agents_that_do_not_answer_are_named_by_why_and_keep_their_identity(clients):
    # GIVEN one agent that timed out, one that failed otherwise, and one whose process is gone
    dead = _dead_pid()
    me, parent = os.getpid(), os.getppid()
    clients({me: errors.Timeout("slow"), parent: RuntimeError("broken"), dead: ConnectionRefusedError()})
    records = [_record(me, 0), _record(parent, 1), _record(dead, 2)]

    # WHEN read
    rows = {r.rank: r for r in progress.read_progress(records, "h", "j").ranks}

    # THEN each row says why, with the registry's rank and no step count
    assert (rows[0].agent, rows[1].agent, rows[2].agent) == ("unresponsive", "error", "gone")
    assert rows[2].process_state == "gone"
    assert all(r.step == 0 and r.last_step_age_s is None for r in rows.values()), "no step is made up"
    assert rows[2].started_at == 12.0, "a gone process keeps the start time of its record"


def test_only_the_jobs_trainers_are_rows_in_rank_order(clients):
    # GIVEN two trainers of job j (rank 1 listed first), its launcher, and a trainer of job k
    me = os.getpid()
    parent = os.getppid()
    dead = _dead_pid()
    records = [
        _record(me, 1),
        _record(parent, None, role="launcher"),
        _record(dead, 0),
        _record(1, 0, job="k"),
    ]
    clients(
        {
            me: pb.Status(rank=1, job_id="j", role="trainer"),
            parent: pb.Status(rank=-1, job_id="j", role="launcher"),
            dead: errors.Timeout("x"),
            1: pb.Status(rank=0, job_id="k", role="trainer"),
        }
    )

    # WHEN job j is read
    node = progress.read_progress(records, "h", "j")

    # THEN its two trainers, rank 0 first; the launcher and job k are not rows
    assert [(r.job, r.rank, r.pid) for r in node.ranks] == [("j", 0, dead), ("j", 1, me)]

    # WHEN every job is read
    every = progress.read_progress(records, "h", None)

    # THEN job k's trainer is there too, after job j's rows
    assert [(r.job, r.rank) for r in every.ranks] == [("j", 0), ("j", 1), ("k", 0)]
