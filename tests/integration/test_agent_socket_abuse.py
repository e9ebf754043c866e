"""The agent's control socket under abuse: idle floods, drip-feeding clients and fuzzed frames.

The job must step through all of it with nothing printed into its output, the CLI must get
through (or say cleanly that it could not), and bad clients are noted in the agent's log only,
throttled.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time

from dynprof.agent._server import MAX_CONNECTIONS, REQUEST_DEADLINE_S
from dynprof.client import AgentClient
from dynprof.proto import PROTOCOL_VERSION, pb, send_frame

PROGRAM = "tests/integration/programs/train_program.py"
FUZZ_CASES = 240
STALLED = 8  # clients stalled mid-frame in the drip test (of MAX_CONNECTIONS slots)


def _job_output_is_clean(lines: list[str]) -> None:
    noisy = [line for line in lines if "dynprof" in line or "Traceback" in line or "Error" in line]
    assert not noisy, "the job's output got dynprof chatter:\n" + "\n".join(noisy[:20])


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)  # blocking: waits while the agent's backlog is full
    s.settimeout(5)
    return s


def test_idle_flood_does_not_lock_out_the_cli(spawn, cli, dynprof_dirs):
    # GIVEN a training job under the agent, and 80 connections that never say anything
    target = spawn([PROGRAM, "--step-sleep", "0.01", "--max-seconds", "90"])
    (pid,) = target.ready_pids()
    sock_path = AgentClient.for_pid(pid).sock_path
    idle = []
    try:
        for _ in range(80):
            idle.append(_connect(sock_path))
        step_before = AgentClient.for_pid(pid, timeout=10).status().step

        # WHEN the CLI asks for stacks and a trace while they are still open
        stacks = cli("stacks", "--pid", str(pid), "--method", "agent", "--no-save", timeout=60)
        start = cli("start", "--pid", str(pid), "--steps", "2", timeout=90)
    finally:
        for s in idle:
            s.close()

    # THEN both got through (the agent answered the flood BUSY or timed it out), with no traceback
    for result in (stacks, start):
        assert "Traceback" not in result.stdout + result.stderr, result.stderr
        assert result.returncode == 0, result.stdout + result.stderr
    assert "train_program.py" in stacks.stdout
    # AND the job kept stepping, and printed nothing
    assert AgentClient.for_pid(pid).status().step > step_before
    _job_output_is_clean(target.lines)
    log = (dynprof_dirs["run"] / "logs" / f"{pid}.log").read_text()
    assert log.count("connection refused, too many at once") == 1
    assert "bad frame" not in "\n".join(target.lines)


def test_a_drip_feeding_client_is_cut_off_at_the_request_deadline(spawn):
    # GIVEN an agent, and a client that sends its request one byte every 1.5 s
    target = spawn([PROGRAM, "--step-sleep", "0.01", "--max-seconds", "90"])
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid)
    request = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=1, ping=pb.Ping()).SerializeToString()
    frame = struct.pack(">I", len(request)) + request
    dripper = _connect(client.sock_path)
    cut_after: list[float] = []
    reply: list[bytes] = []

    def drip() -> None:
        t0 = time.monotonic()
        try:
            for byte in frame:
                dripper.send(bytes([byte]))
                time.sleep(1.5)
            reply.append(dripper.recv(4096))
        except OSError:
            pass
        cut_after.append(time.monotonic() - t0)

    thread = threading.Thread(target=drip)
    thread.start()
    # and STALLED clients that sent the first byte of a frame and nothing more: an agent that
    # served one connection at a time would answer the next client only after cutting each of
    # them at its deadline, STALLED * REQUEST_DEADLINE_S seconds at least
    stalled = [_connect(client.sock_path) for _ in range(STALLED)]
    for s in stalled:
        s.send(frame[:1])
    try:
        # WHEN another client asks while they are connected
        t0 = time.monotonic()
        step = AgentClient.for_pid(pid, timeout=120).status().step
        answered_in = time.monotonic() - t0
        thread.join(timeout=len(frame) * 1.5 + 60)
    finally:
        dripper.close()
        for s in stalled:
            s.close()

    # THEN the other client was answered at once, not after the stalled clients' deadlines, and
    # the dripper was cut off at the deadline, long before it could send its whole request
    assert answered_in < STALLED * REQUEST_DEADLINE_S / 2, answered_in
    assert step > 0
    assert cut_after and cut_after[0] < len(frame) * 1.5 / 2, (cut_after, len(frame))
    assert not reply or b"not complete within" in reply[0]
    assert client.status().step > step
    _job_output_is_clean(target.lines)


def test_fuzzed_frames_leave_the_job_stepping_and_silent(spawn, dynprof_dirs):
    # GIVEN an agent in a training job
    target = spawn([PROGRAM, "--step-sleep", "0.01", "--max-seconds", "120"])
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid)
    step_before = client.status().step
    rng = random.Random(1234)
    valid = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=5, ping=pb.Ping()).SerializeToString()

    def case(i: int) -> bytes:
        kind = i % 6
        if kind == 0:  # random bytes
            return rng.randbytes(rng.randint(0, 64))
        if kind == 1:  # a header announcing a huge frame
            return struct.pack(">I", rng.randint(64 * 1024 + 1, 2**32 - 1)) + rng.randbytes(8)
        if kind == 2:  # a truncated frame
            return struct.pack(">I", 100) + rng.randbytes(rng.randint(0, 99))
        if kind == 3:  # a well-framed random payload
            body = rng.randbytes(rng.randint(0, 200))
            return struct.pack(">I", len(body)) + body
        if kind == 4:  # a valid request with bytes flipped
            body = bytearray(valid)
            for _ in range(rng.randint(1, 3)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            return struct.pack(">I", len(body)) + bytes(body)
        return struct.pack(">I", len(valid)) + valid + rng.randbytes(rng.randint(1, 16))  # trailing junk

    # WHEN many clients send fuzzed frames and hang up (some without waiting for an answer)
    answered = 0
    for i in range(FUZZ_CASES):
        s = _connect(client.sock_path)
        try:
            s.sendall(case(i))
            s.shutdown(socket.SHUT_WR)
            if i % 2:
                s.settimeout(REQUEST_DEADLINE_S + 3)
                if s.recv(4):
                    answered += 1
        except OSError:
            pass
        finally:
            s.close()

    # THEN the agent still answers, the job kept stepping, and its output stayed clean
    ping = client.request(ping=pb.Ping())
    assert ping.pong.dynprof_version
    assert client.status().step > step_before
    assert answered >= FUZZ_CASES // 4
    time.sleep(0.2)
    _job_output_is_clean(target.lines)
    # AND the agent's log notes the bad frames once, not once each
    log = (dynprof_dirs["run"] / "logs" / f"{pid}.log").read_text()
    assert 1 <= log.count("bad frame from a client") <= 2, log[-2000:]
    assert target.proc.poll() is None


def test_the_agent_answers_busy_beyond_its_connection_limit(spawn):
    # GIVEN an agent whose connection slots are all held by silent clients (each slot is held
    # for the request deadline, 2 s: on a loaded machine the agent may not have accepted all of
    # them when the extra client comes, and then serves it; the scenario is tried again, up to 5
    # times. tests/unit/test_protocol.py holds the slots without a time limit.)
    target = spawn([PROGRAM, "--step-sleep", "0.01", "--max-seconds", "240"])
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid)
    replies = []
    for _attempt in range(5):
        holders = [_connect(client.sock_path) for _ in range(MAX_CONNECTIONS)]
        try:
            time.sleep(0.3)
            # WHEN one more client sends a request
            extra = _connect(client.sock_path)
            extra.settimeout(60)
            # A full agent answers BUSY and closes as soon as it accepts, possibly before the
            # request is written: the write may then fail, and the answer is still there to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_frame(
                    extra,
                    pb.Request(protocol_version=PROTOCOL_VERSION, request_id=9, ping=pb.Ping()).SerializeToString(),
                )
            data = extra.recv(4096)
            extra.close()
            reply = pb.Reply()
            reply.ParseFromString(data[4:])
            replies.append(reply)
            # AND the CLI's client asks too (patient: a loaded machine frees the slots late)
            t0 = time.monotonic()
            status = AgentClient.for_pid(pid, timeout=120).status()
            waited = time.monotonic() - t0
        finally:
            for s in holders:
                s.close()
        if reply.HasField("error"):
            break
        time.sleep(REQUEST_DEADLINE_S + 1)  # every slot of this attempt is free again

    # THEN the extra connection was answered BUSY for request 0 (its request was never read),
    # and every other attempt was served normally (never another error)
    assert replies[-1].error.code == pb.BUSY and replies[-1].request_id == 0
    assert all(r.request_id == 9 and r.HasField("pong") for r in replies[:-1])
    # AND the client retried until a slot freed up (when the agent cut the silent clients at
    # their deadline), not until its own timeout
    assert status.pid == pid
    assert waited < 60
    _job_output_is_clean(target.lines)
