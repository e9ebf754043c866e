"""The agent in real processes: activation, robustness against bad clients, errors people see."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from dynprof.client import AgentClient
from dynprof.proto import PROTOCOL_VERSION, pb, recv_frame, send_frame
from tests.support.other_user import as_nobody, needs_root

PROGRAM = "tests/integration/programs/train_program.py"
ROOT = Path(__file__).resolve().parents[2]
# The loop that tests which only talk to a process share (the module's ``shared_target``): one
# under `dynprof run`, one plain python.
LOOP = [PROGRAM, "--step-sleep", "0.01", "--max-seconds", "1800"]


def _agents(cli):
    return json.loads(cli("ps", "--json").stdout)["agents"]


def test_dynprof_run_passes_the_exit_code_through(cli):
    result = cli("run", "-q", "--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert result.returncode == 7


def test_dynprof_run_reports_a_missing_command(cli):
    result = cli("run", "--", "no-such-command-xyz")
    assert result.returncode == 2
    assert "command not found: no-such-command-xyz" in result.stderr


def test_pth_hook_starts_the_agent_with_DYNPROF_set(spawn, cli):
    # GIVEN a plain python process (no `dynprof run`) with DYNPROF=1, relying on the installed .pth
    target = spawn([PROGRAM, "--step-sleep", "0.01"], under_run=False, env={"DYNPROF": "1"})
    (pid,) = target.ready_pids()
    # THEN it registered an agent that counts steps
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        agents = {a["pid"]: a for a in _agents(cli)}
        if pid in agents and agents[pid]["step"]:
            break
        time.sleep(0.1)
    assert agents[pid]["activation"] == "pth"
    assert agents[pid]["step"] > 0


def test_pth_hook_does_nothing_without_DYNPROF(shared_target, cli):
    target = shared_target(LOOP, under_run=False)
    (pid,) = target.ready_pids()
    assert pid not in {a["pid"] for a in _agents(cli)}


def test_agent_started_from_code(spawn, cli):
    target = spawn([PROGRAM, "--agent-api", "--step-sleep", "0.01"], under_run=False)
    (pid,) = target.ready_pids()
    (agent,) = [a for a in _agents(cli) if a["pid"] == pid]
    assert agent["activation"] == "api"


def test_registration_record_describes_the_process(spawn, dynprof_dirs):
    target = spawn(
        [PROGRAM, "--step-sleep", "0.01"],
        env={"DYNPROF_JOB_ID": "recjob", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
    )
    (pid,) = target.ready_pids()
    record = json.loads((dynprof_dirs["run"] / "agents" / f"{pid}.json").read_text())
    assert record["job_id"] == "recjob" and record["rank"] == 3 and record["world_size"] == 4
    assert record["local_rank"] == 1 and record["pid"] == pid
    assert PROGRAM in " ".join(record["cmdline"])
    # the agent starts before the job imports torch, and records torch's version once it does
    import torch

    assert record["torch_version"] == torch.__version__
    assert oct((dynprof_dirs["run"] / "agents").stat().st_mode & 0o777) == "0o700"


def test_records_go_away_at_exit_and_after_a_kill(spawn, cli, dynprof_dirs):
    agents = dynprof_dirs["run"] / "agents"
    # GIVEN a process that exits normally: the agent removes its own record and socket
    ending = spawn([PROGRAM, "--max-steps", "20"])
    (pid1,) = ending.ready_pids()
    ending.wait_for_line("DONE")
    ending.proc.wait(timeout=30)
    assert not (agents / f"{pid1}.json").exists() and not (agents / f"{pid1}.sock").exists()
    # GIVEN a process killed without a chance to clean up
    killed = spawn([PROGRAM, "--step-sleep", "0.01"])
    (pid2,) = killed.ready_pids()
    assert (agents / f"{pid2}.json").exists()
    killed.proc.kill()
    killed.proc.wait()
    # THEN the next listing drops and removes its stale record
    assert pid2 not in {a["pid"] for a in json.loads(cli("ps", "--json").stdout)["agents"]}
    assert not (agents / f"{pid2}.json").exists() and not (agents / f"{pid2}.sock").exists()


def test_agent_survives_malformed_and_oversized_frames(shared_target):
    # GIVEN an agent
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid)

    def raw(data: bytes, expect_reply: bool = True):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(client.sock_path)
        s.sendall(data)
        try:
            if expect_reply:
                reply = pb.Reply()
                reply.ParseFromString(recv_frame(s))
                return reply
            return s.recv(1)
        finally:
            s.close()

    # WHEN clients send garbage, an oversized frame, a truncated frame, a wrong version
    garbage = raw(struct.pack(">I", 5) + b"\xff\xfe\xfd\xfc\xfb")
    oversized = raw(struct.pack(">I", 1 << 30))
    s = socket.socket(socket.AF_UNIX)
    s.connect(client.sock_path)
    s.sendall(struct.pack(">I", 100) + b"abc")
    s.close()
    wrong = raw(
        struct.pack(
            ">I", len(b := pb.Request(protocol_version=PROTOCOL_VERSION + 1, ping=pb.Ping()).SerializeToString())
        )
        + b
    )

    # THEN each gets a structured error, and the agent still answers and the job still steps
    assert garbage.error.code == pb.BAD_REQUEST
    assert oversized.error.code == pb.BAD_REQUEST
    assert wrong.error.code == pb.VERSION_MISMATCH
    first = client.status().step
    # the job steps again (within a deadline that only bounds a hang: on a loaded machine the
    # job may not be scheduled for a step within any short fixed sleep)
    deadline = time.monotonic() + 60
    while client.status().step <= first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.status().step > first
    assert target.proc.poll() is None


def test_agent_ignores_a_client_that_never_sends(shared_target):
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid, timeout=120)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(client.sock_path)  # says nothing; the agent times it out
    try:
        t0 = time.monotonic()
        assert client.request(ping=pb.Ping()).pong.dynprof_version
        assert time.monotonic() - t0 < 60  # answered, not left waiting behind the silent one
    finally:
        silent.close()


# -- errors people see ----------------------------------------------------------------------------
def test_no_agent_in_a_plain_process(shared_target, cli):
    target = shared_target(LOOP, under_run=False)
    (pid,) = target.ready_pids()
    result = cli("start", "--pid", str(pid), "--steps", "2")
    assert result.returncode == 5
    assert f"process {pid} has no dynprof agent" in result.stderr
    assert f"dynprof attach {pid}" in result.stderr and "--attach" in result.stderr
    assert "dynprof run" in result.stderr and "DYNPROF=1" in result.stderr


def test_dead_pid(cli):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    result = cli("start", "--pid", str(proc.pid), "--steps", "2")
    assert result.returncode == 3
    assert f"no process with pid {proc.pid}" in result.stderr


def test_process_without_torch_is_reported(spawn, cli):
    target = spawn(["-c", "import os,time; print('READY', os.getpid(), flush=True); time.sleep(60)"])
    (pid,) = target.ready_pids()
    result = cli("start", "--pid", str(pid), "--steps", "2")
    assert result.returncode == 7
    assert "torch is not imported" in result.stderr


def test_stop_without_a_trace(shared_target, cli):
    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    result = cli("stop", "--pid", str(pid))
    assert result.returncode == 1
    assert "no trace is running" in result.stdout


def test_unknown_job(cli):
    result = cli("start", "--job", "no-such-job", "--steps", "1")
    assert result.returncode in (1, 5)
    assert "no-such-job" in result.stderr or "no dynprof agent" in result.stderr


@needs_root
def test_another_users_process_is_refused_with_a_clear_message(shared_target):
    from dynprof.cli import main

    target = shared_target(LOOP)
    (pid,) = target.ready_pids()
    code, err = as_nobody(lambda: main(["start", "--pid", str(pid), "--steps", "2"]))
    assert code == 4, err
    assert f"process {pid} belongs to another user" in err
    assert "same user" in err


@needs_root
def test_agent_refuses_commands_from_another_uid(spawn, dynprof_dirs):
    # GIVEN an agent whose socket another user could reach (directories opened up on purpose)
    target = spawn([PROGRAM, "--step-sleep", "0.01"])
    (pid,) = target.ready_pids()
    sock_path = AgentClient.for_pid(pid).sock_path
    os.chmod(dynprof_dirs["run"], 0o755)
    os.chmod(dynprof_dirs["run"] / "agents", 0o755)
    os.chmod(sock_path, 0o666)

    def connect_and_ping() -> int:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(sock_path)
        try:
            send_frame(
                s, pb.Request(protocol_version=PROTOCOL_VERSION, request_id=1, ping=pb.Ping()).SerializeToString()
            )
            data = s.recv(4)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        return 10 if data == b"" else 11  # 10: the agent hung up without answering

    # WHEN the nobody user sends a valid request, THEN the agent closes without serving it
    code, err = as_nobody(connect_and_ping)
    assert code == 10, err
    assert AgentClient.for_pid(pid).status().pid == pid
