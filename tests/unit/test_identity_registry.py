"""Rank/job detection, registration records and target selection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from collectors.torch_trace.align import alignment_step
from dynprof.agents import select_workers
from dynprof.identity import detect
from dynprof.proto import pb
from dynprof.registry import list_records, process_start_ticks, write_record
from tests.support.records import agent_record


def test_torchrun_environment():
    ident = detect({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "abc"})
    assert (ident.rank, ident.local_rank, ident.world_size, ident.job_id) == (3, 1, 8, "abc")


def test_slurm_environment_and_dynprof_override():
    ident = detect({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "777"})
    assert (ident.rank, ident.world_size, ident.job_id) == (5, 16, "777")
    ident = detect({"SLURM_JOB_ID": "777", "DYNPROF_JOB_ID": "mine"})
    assert ident.job_id == "mine"


def test_torchrun_default_run_id_is_not_a_job_id():
    assert detect({"TORCHELASTIC_RUN_ID": "none"}).job_id is None


def _record(pid, rank=None, job="j", ppid=1, started=0.0):
    return agent_record(pid, ppid=ppid, rank=rank, world_size=2, job_id=job, started_at=started)


def test_select_workers_drops_launcher_and_dataloader_children():
    launcher = _record(100, rank=None)
    r0 = _record(101, rank=0, ppid=100)
    r1 = _record(102, rank=1, ppid=100)
    worker_of_r0 = _record(103, rank=0, ppid=101)
    other_job = _record(200, rank=None, job="other")
    chosen = select_workers([launcher, r0, r1, worker_of_r0, other_job])
    assert [r.pid for r in chosen] == [101, 102, 200]


def test_records_of_dead_processes_are_cleaned_up(dynprof_dirs):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_record(_record(dead.pid))
    alive = _record(os.getpid(), started=1.0)
    alive.start_ticks = process_start_ticks(os.getpid())
    write_record(alive)
    assert [r.pid for r in list_records()] == [os.getpid()]
    assert not (dynprof_dirs["run"] / "agents" / f"{dead.pid}.json").exists()


def test_the_record_of_an_exited_process_not_yet_reaped_is_cleaned_up(dynprof_dirs):
    import time

    # GIVEN a record of a process that has exited and that its parent has not reaped (a zombie:
    # a rank killed by SIGTERM whose launcher has not waited for it yet)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    record = _record(zombie.pid)
    record.start_ticks = process_start_ticks(zombie.pid)
    write_record(record)
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{zombie.pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # WHEN the records are listed
        listed = list_records()
        # THEN it is gone: not listed, its record removed
        assert zombie.pid not in [r.pid for r in listed]
        assert not (dynprof_dirs["run"] / "agents" / f"{zombie.pid}.json").exists()
    finally:
        zombie.wait()


def test_a_record_whose_socket_still_answers_is_not_deleted(dynprof_dirs):
    # GIVEN a record whose pid means nothing here (an agent in another pid namespace, as a
    # pod's agent looks from a node's sidecar) but whose socket is listened on
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_record(_record(dead.pid))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(dynprof_dirs["run"] / "agents" / f"{dead.pid}.sock"))
    listener.listen(1)
    try:
        # WHEN the records are listed
        listed = list_records()

        # THEN it is not listed (its pid cannot be used here), and not deleted either
        assert dead.pid not in [r.pid for r in listed]
        assert (dynprof_dirs["run"] / "agents" / f"{dead.pid}.json").exists()
    finally:
        listener.close()
    # AND once nothing listens, it is cleaned up as any dead record
    list_records()
    assert not (dynprof_dirs["run"] / "agents" / f"{dead.pid}.json").exists()


def test_reused_pid_is_not_taken_for_the_old_agent():
    rec = _record(os.getpid())
    rec.start_ticks = (process_start_ticks(os.getpid()) or 0) + 12345
    assert not rec.is_alive()


def test_alignment_step_covers_the_lead_time_of_the_fastest_rank():
    fast = pb.Status(step=100, step_time_s=0.001)
    slow = pb.Status(step=98, step_time_s=0.01)
    assert alignment_step([fast, slow], lead_s=0.3) == 100 + 301
    assert alignment_step([pb.Status(step=5), pb.Status(step=7)]) == 9


def test_multiprocessing_service_interpreters_get_no_agent():
    from dynprof.roles import is_multiprocessing_service

    tracker = ["/usr/bin/python3", "-B", "-c", "from multiprocessing.resource_tracker import main;main(8)"]
    spawned = ["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=9)"]
    assert is_multiprocessing_service(tracker)
    assert not is_multiprocessing_service(spawned)
    assert not is_multiprocessing_service(["python", "train.py"])


def test_alignment_takes_no_crafted_step_time_for_a_pace():
    from types import SimpleNamespace

    from collectors.torch_trace.align import boundary_offsets

    for crafted in (5e-324, 1e-320, float("nan"), float("inf"), -1.0, 0.0):
        # GIVEN a process whose step time is no measurement, beside one at 100 ms a step
        statuses = [
            SimpleNamespace(step=40, step_time_s=crafted, last_step_at=1000.0),
            SimpleNamespace(step=41, step_time_s=0.1, last_step_at=1000.05),
        ]
        # WHEN the common step is planned (0.3 s ahead)
        at = alignment_step(statuses, 0.3)
        # THEN it comes from the real pace: 0.3 s at 100 ms a step, past the furthest process
        assert at == 41 + 4, crafted
        # and the boundary offsets come from the real step time only
        assert boundary_offsets(statuses) == [0, 1], crafted
    # and with no real pace at all, two steps ahead; no offsets
    alone = [SimpleNamespace(step=40, step_time_s=5e-324, last_step_at=float("nan"))]
    assert alignment_step(alone, 0.3) == 42
    assert boundary_offsets(alone) is None


def _dead_pids(n):
    procs = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(n)]
    for p in procs:
        p.wait()
    return [p.pid for p in procs]


def test_logs_of_gone_processes_are_pruned_by_age_and_count(dynprof_dirs, monkeypatch):
    from dynprof import registry

    run = dynprof_dirs["run"]
    logs = run / "logs"
    logs.mkdir(exist_ok=True)
    (run / "agents").mkdir(exist_ok=True)
    week = registry.LOG_KEEP_S
    old_dead, young_dead, recorded, *more = _dead_pids(7)
    now = 1_000_000_000.0

    def log(pid, age):
        path = logs / f"{pid}.log"
        path.write_text("x")
        os.utime(path, (now - age, now - age))
        return path

    # GIVEN the logs of a process gone 8 days, one gone a day, one whose record is still there
    # (an agent in another pid namespace), this process's own (8 days old) and other files
    gone = log(old_dead, week + 86400)
    young = log(young_dead, 86400)
    kept_by_record = log(recorded, week + 86400)
    write_record(_record(recorded), run / "agents")
    mine = log(os.getpid(), week + 86400)
    other = logs / "notes.txt"
    other.write_text("y")
    # WHEN they are pruned
    removed = registry.prune_logs(logs, run / "agents", now=now)
    # THEN only the old log of the gone process is removed
    assert removed == [gone] and not gone.exists()
    assert young.exists() and kept_by_record.exists() and mine.exists() and other.exists()

    # GIVEN more logs of gone processes than are kept (all young)
    monkeypatch.setattr(registry, "MAX_DEAD_LOGS", 2)
    extra = [log(pid, 10.0 * (len(more) - i)) for i, pid in enumerate(more)]  # oldest first
    # WHEN they are pruned THEN the oldest go first, down to the bound (the young one of before too)
    removed = registry.prune_logs(logs, run / "agents", now=now)
    assert sorted(removed) == sorted([young, *extra[:-2]])
    assert all(p.exists() for p in extra[-2:]) and mine.exists() and kept_by_record.exists()


def test_listing_the_agents_prunes_the_logs_at_most_every_few_minutes(dynprof_dirs, monkeypatch):
    from dynprof import registry

    run = dynprof_dirs["run"]
    (run / "logs").mkdir(exist_ok=True)
    (run / "agents").mkdir(exist_ok=True)
    calls = []
    monkeypatch.setattr(registry, "prune_logs", lambda logs, agents: calls.append(logs) or [])
    monkeypatch.setattr(registry, "_last_prune", {})
    # WHEN the agents are listed twice in a row
    list_records()
    list_records()
    # THEN the run directory's logs were pruned once
    assert calls == [run / "logs"]
