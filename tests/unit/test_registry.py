"""dynprof.registry: agents' registration records, read back as the untrusted input they are."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dynprof import registry
from dynprof.registry import (
    AgentRecord,
    has_agent_children,
    list_records,
    process_start_ticks,
    prune_logs,
    read_record,
    record_path,
    remove_record,
    socket_path,
    write_record,
)
from tests.support.records import agent_record


def _record(pid: int | None = None, **more) -> AgentRecord:
    fields = dict(
        rank=0,
        world_size=1,
        job_id="j",
        cmdline=["python", "train.py"],
        python_version="3.11",
        started_at=1.0,
        socket="/x.sock",
    )
    fields.update(more)
    return agent_record(pid or os.getpid(), **fields)


def test_a_record_written_reads_back_the_same(dynprof_dirs):
    # GIVEN a record WHEN it is written and read back
    record = _record(role="trainer", extra={"k": [1]})
    path = write_record(record)
    # THEN it is the same record, at <run dir>/agents/<pid>.json, and no temporary is left
    assert path == dynprof_dirs["run"] / "agents" / f"{record.pid}.json"
    assert read_record(record.pid) == record
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_record_and_socket_paths_sit_side_by_side(tmp_path):
    assert record_path(12, tmp_path) == tmp_path / "12.json"
    assert socket_path(12, tmp_path) == tmp_path / "12.sock"


def test_remove_record_removes_both_files_and_minds_no_missing_one(tmp_path):
    record_path(5, tmp_path).write_text("{}")
    socket_path(5, tmp_path).write_text("")
    remove_record(5, tmp_path)
    assert list(tmp_path.iterdir()) == []
    remove_record(5, tmp_path)  # nothing there: no error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", True),
        ("pid", 0),
        ("pid", 2**22 + 1),
        ("pid", "12"),
        ("ppid", 1.5),
        ("rank", "0"),
        ("rank", False),
        ("start_ticks", 1.0),
        ("host", None),
        ("socket", 5),
        ("role", "emperor"),
        ("job_id", 5),
        ("cmdline", "python train.py"),
        ("cmdline", ["python", 3]),
        ("started_at", "now"),
        ("started_at", True),
        ("extra", []),
    ],
)
def test_an_ill_formed_record_is_a_value_or_type_error(field, value):
    data = _record().to_dict()
    data[field] = value
    with pytest.raises((ValueError, TypeError)):
        AgentRecord.from_dict(data)


def test_a_record_that_is_not_an_object_or_lacks_fields_is_a_type_error():
    with pytest.raises(TypeError, match="a record is a JSON object, not list"):
        AgentRecord.from_dict([1, 2])
    data = _record().to_dict()
    del data["host"]
    with pytest.raises(TypeError):
        AgentRecord.from_dict(data)


def test_unknown_fields_are_ignored_for_a_newer_agents_record():
    data = {**_record().to_dict(), "from_the_future": 1}
    assert AgentRecord.from_dict(data) == _record()


def test_text_that_is_not_utf8_is_read_escaped_so_every_reader_can_encode_it():
    # GIVEN a record whose job id and command line hold lone surrogates (bytes that were not UTF-8)
    data = {**_record().to_dict(), "job_id": "bad\udcff", "cmdline": ["python", "x\udcfe"]}
    # WHEN it is read
    record = AgentRecord.from_dict(data)
    # THEN the text encodes, with the bad bytes shown escaped
    assert "\\xff" in record.job_id and "\\xfe" in record.cmdline[1]  # type: ignore[operator]
    json.dumps(record.to_dict()).encode("utf-8")
    record.job_id.encode("utf-8")  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"pid": 1}', "null", "[" * 100_000])
def test_read_record_of_a_garbled_file_is_none(dynprof_dirs, text):
    path = record_path(os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    assert read_record(os.getpid()) is None


def test_read_record_of_a_missing_file_is_none():
    assert read_record(os.getpid()) is None


def test_a_failed_write_leaves_no_half_written_record(dynprof_dirs, monkeypatch):
    # GIVEN a replace that fails (a full disk, say)
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(registry.os, "replace", fail)
    # WHEN a record is written THEN the error reaches the caller and nothing is left behind
    with pytest.raises(OSError, match="No space left"):
        write_record(_record())
    assert list((dynprof_dirs["run"] / "agents").iterdir()) == []


def test_this_process_is_alive_by_its_start_time_and_a_reused_pid_is_not():
    ticks = process_start_ticks(os.getpid())
    assert isinstance(ticks, int) and ticks > 0
    assert _record(start_ticks=ticks).is_alive()
    assert _record(start_ticks=None).is_alive(), "no start time known: the pid alone"
    assert not _record(start_ticks=ticks + 1).is_alive(), "another start time: a reused pid"


def test_a_process_that_is_gone_is_not_alive_and_has_no_start_time():
    child = subprocess.Popen(["true"])
    child.wait()
    assert not _record(pid=child.pid).is_alive()
    assert process_start_ticks(child.pid) is None


def test_list_records_lists_live_agents_newest_first_and_skips_garbage(dynprof_dirs):
    # GIVEN records of this process and of its parent, and a garbled file
    write_record(_record(started_at=1.0))
    write_record(_record(pid=os.getppid(), started_at=2.0))
    (dynprof_dirs["run"] / "agents" / "99.json").write_text("not json")
    # WHEN / THEN the live ones, newest first
    assert [r.pid for r in list_records()] == [os.getppid(), os.getpid()]


def test_a_dead_agent_record_is_kept_when_not_cleaning(dynprof_dirs):
    child = subprocess.Popen(["true"])
    child.wait()
    write_record(_record(pid=child.pid))
    assert list_records(clean=False) == []
    assert record_path(child.pid).exists(), "clean=False reads without deleting"
    assert list_records() == []
    assert not record_path(child.pid).exists()


def test_an_agent_child_of_the_same_job_makes_a_launcher(dynprof_dirs):
    # GIVEN our process's record as a child of our parent, in job "j", rank 0
    write_record(_record(ppid=os.getppid(), rank=0, job_id="j", role="trainer"))
    # THEN the parent has an agent child of job j (unless it shares that child's rank)
    assert has_agent_children(os.getppid(), "j", rank=None)
    assert not has_agent_children(os.getppid(), "j", rank=0), "a helper of the parent's own rank"
    assert not has_agent_children(os.getppid(), "other")


def test_prune_logs_keeps_logs_of_live_processes_and_records_and_skips_odd_names(tmp_path):
    # GIVEN a logs directory with old logs of a gone pid, of this live process, of a pid with a
    # record, a file of another name, and a link named like a log
    logs, agents = tmp_path / "logs", tmp_path / "agents"
    logs.mkdir()
    agents.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    recorded = 2**22 + 7
    for name in (f"{gone.pid}.log", f"{os.getpid()}.log", f"{recorded}.log", "notes.txt"):
        (logs / name).write_text("x")
        os.utime(logs / name, (0, 0))
    (agents / f"{recorded}.json").write_text("{}")
    (logs / "4194999.log").symlink_to(logs / "notes.txt")
    # WHEN pruned a long time later
    removed = prune_logs(logs, agents, now=registry.LOG_KEEP_S * 10)
    # THEN only the gone process's log went
    assert removed == [logs / f"{gone.pid}.log"]
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"{os.getpid()}.log", f"{recorded}.log", "notes.txt", "4194999.log"]
    )


def test_prune_logs_keeps_recent_logs_up_to_the_count_and_removes_the_oldest_beyond(tmp_path, monkeypatch):
    # GIVEN four recent logs of gone processes and a limit of two
    monkeypatch.setattr(registry, "MAX_DEAD_LOGS", 2)
    monkeypatch.setattr(registry, "pid_alive", lambda pid: False)
    logs, agents = tmp_path / "logs", tmp_path / "agents"
    logs.mkdir()
    agents.mkdir()
    for i, pid in enumerate((11, 12, 13, 14)):
        (logs / f"{pid}.log").write_text("x")
        os.utime(logs / f"{pid}.log", (1000 + i, 1000 + i))
    # WHEN pruned soon after THEN the two oldest go
    removed = prune_logs(logs, agents, now=2000)
    assert sorted(p.name for p in removed) == ["11.log", "12.log"]
