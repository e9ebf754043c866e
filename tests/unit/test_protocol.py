"""Wire protocol: framing, the generated module, and the agent's dispatch of bad input."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dynprof.agent._server import CommandError, ControlServer
from dynprof.proto import PROTOCOL_VERSION, FrameError, pb, recv_frame, send_frame

ROOT = Path(__file__).resolve().parents[2]


def test_generated_module_is_current():
    # The checked-in dynprof_pb2.py must match dynprof.proto (regenerate: make proto).
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_frame_round_trip():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"hello")
        assert recv_frame(b) == b"hello"


def test_oversized_frame_is_refused_without_reading_it():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 10_000_000))
        with pytest.raises(FrameError, match="exceeds"):
            recv_frame(b, max_bytes=1024)


def test_truncated_frame_is_an_error():
    a, b = socket.socketpair()
    with b:
        a.sendall(struct.pack(">I", 100) + b"abc")
        a.close()
        with pytest.raises(FrameError, match="closed"):
            recv_frame(b)


def _server(handlers):
    return ControlServer(socket.socket(socket.AF_UNIX), "/nonexistent", handlers)


def _request(**command):
    req = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=7)
    ((name, msg),) = command.items()
    getattr(req, name).CopyFrom(msg)
    return req.SerializeToString()


def test_dispatch_answers_with_the_handler_result():
    server = _server({"ping": lambda m: ("pong", pb.Pong(dynprof_version="x"))})
    reply = server.dispatch(_request(ping=pb.Ping()))
    assert reply.request_id == 7 and reply.pong.dynprof_version == "x"
    assert not reply.HasField("error")


@pytest.mark.parametrize(
    "data,code",
    [
        (b"\xff\xff\xff garbage", pb.BAD_REQUEST),
        (pb.Request(protocol_version=PROTOCOL_VERSION).SerializeToString(), pb.BAD_REQUEST),
        (pb.Request(protocol_version=99, ping=pb.Ping()).SerializeToString(), pb.VERSION_MISMATCH),
        (_request(stop_trace=pb.StopTraceRequest()), pb.UNKNOWN_COMMAND),
    ],
    ids=["garbage", "no-command", "version", "unknown"],
)
def test_dispatch_rejects_bad_requests_with_structured_errors(data, code):
    server = _server({"ping": lambda m: ("pong", pb.Pong())})
    reply = server.dispatch(data)
    assert reply.HasField("error")
    assert reply.error.code == code


def test_handler_failures_become_error_replies():
    def broken(_):
        raise ValueError("nope")

    def refusing(_):
        raise CommandError(pb.BUSY, "busy now", "wait")

    server = _server({"ping": broken, "status": refusing})
    r1 = server.dispatch(_request(ping=pb.Ping()))
    assert r1.error.code == pb.INTERNAL and "nope" in r1.error.message
    r2 = server.dispatch(_request(status=pb.StatusRequest()))
    assert (r2.error.code, r2.error.message, r2.error.help) == (pb.BUSY, "busy now", "wait")


def test_a_handler_answering_the_wrong_message_gets_an_error_reply_not_a_hang_up():
    # GIVEN handlers that answer a message the reply field cannot hold, or a field that is not one
    server = _server({"ping": lambda m: ("pong", pb.Status()), "status": lambda m: ("no_such_field", pb.Pong())})
    # THEN each request is answered with an INTERNAL error naming the command
    for req, name in ((_request(ping=pb.Ping()), "ping"), (_request(status=pb.StatusRequest()), "status")):
        reply = server.dispatch(req)
        assert reply.error.code == pb.INTERNAL and reply.error.message.startswith(f"{name} failed"), reply
        assert not reply.WhichOneof("result")


def test_client_retries_a_full_backlog_then_says_busy(tmp_path):
    import time

    from dynprof import errors
    from dynprof.client import AgentClient

    # GIVEN a listening socket that never accepts, its backlog filled
    path = str(tmp_path / "a.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(0)
    fillers = []
    try:
        while True:
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        # WHEN a client asks
        t0 = time.monotonic()
        with pytest.raises(errors.Busy) as info:
            AgentClient(pid=123, sock_path=path, timeout=0.5).request(ping=pb.Ping())
        # THEN it retried for its timeout (at least; then gave up: not the 60-fold), then said
        # why, with the "busy" exit code
        assert 0.3 < time.monotonic() - t0 < 30
        assert "queue stayed full" in info.value.message and info.value.exit_code == 6
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_client_retries_a_busy_answer_for_an_unread_request(tmp_path):
    import threading

    from dynprof.client import AgentClient

    # GIVEN a server that answers the first connection BUSY (request 0), then serves normally
    path = str(tmp_path / "b.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(4)
    server = _server({"ping": lambda m: ("pong", pb.Pong(dynprof_version="v"))})

    def serve() -> None:
        conn, _ = listener.accept()
        server._reply_error(conn, 0, pb.BUSY, "full", timeout=0.0)
        conn.close()
        conn, _ = listener.accept()
        with conn:
            send_frame(conn, server.dispatch(recv_frame(conn)).SerializeToString())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        # WHEN a client asks, THEN it gets the real answer on its second attempt
        reply = AgentClient(pid=1, sock_path=path, timeout=3).request(ping=pb.Ping())
        assert reply.pong.dynprof_version == "v"
    finally:
        thread.join(timeout=5)
        listener.close()


def test_client_noise_logs_the_first_note_then_counts():
    import logging

    from dynprof.agent._server import ClientNoise

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("dynprof.agent")
    handler, old_level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        # GIVEN a flood of 500 bad frames within one interval
        noise = ClientNoise(interval=60.0)
        for i in range(500):
            noise.note("bad frame from a client", f"case {i}")
        # WHEN the agent stops
        noise.flush()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    # THEN the log holds the first in full and one count for the rest, all at INFO (not the job's stderr)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("bad frame from a client: case 0")
    assert lines[1] == "bad frame from a client: 499 more since the last note"
    assert all(r.levelno == logging.INFO for r in records)
    assert noise.counts["bad frame from a client"] == 500


def test_a_connection_beyond_the_limit_is_answered_busy_while_the_slots_are_held(tmp_path):
    # GIVEN an agent server with 2 slots, both held by silent clients, and a request deadline far
    # longer than any machine needs to accept them (the slots stay held however slow it is)
    path = str(tmp_path / "agent.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(8)
    server = ControlServer(sock, path, {"ping": lambda m: ("pong", pb.Pong())}, max_connections=2, request_deadline=600)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    holders = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            holders.append(s)
        deadline = time.monotonic() + 120
        while server._slots._value > 0 and time.monotonic() < deadline:  # both accepted
            time.sleep(0.01)
        assert server._slots._value == 0

        # WHEN one more client sends a request
        with socket.socket(socket.AF_UNIX) as extra:
            extra.settimeout(120)
            extra.connect(path)
            # BUSY is answered at accept, and the connection closed: the write may fail
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_frame(extra, _request(ping=pb.Ping()))
            data = recv_frame(extra, max_bytes=1 << 20)

        # THEN it is answered BUSY for request 0 (its request was never read)
        reply = pb.Reply()
        reply.ParseFromString(data)
        assert reply.error.code == pb.BUSY and reply.request_id == 0
    finally:
        for s in holders:
            s.close()
        server.close()
        thread.join(30)
