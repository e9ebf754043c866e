"""The agent's control socket (dynprof/agent/_server.py) on a real Unix socket: one request, one
reply; a client that sends nothing in time or too much gets a structured error; a handler's
failure reaches the job's stderr once per command; notes about bad clients go to the log only,
counted; close ends the accept loop and removes the socket."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynprof.agent._server import MAX_REQUEST_BYTES, ClientNoise, CommandError, ControlServer
from dynprof.proto import PROTOCOL_VERSION, pb, recv_frame, send_frame


def _request(request_id: int = 7, **command: Any) -> bytes:
    req = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=request_id)
    ((name, msg),) = command.items()
    getattr(req, name).CopyFrom(msg)
    return req.SerializeToString()


class _Running:
    def __init__(self, server: ControlServer, thread: threading.Thread, path: str) -> None:
        self.server, self.thread, self.path = server, thread, path

    def connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(10)
        conn.connect(self.path)
        return conn

    def ask(self, data: bytes) -> Any:
        with self.connect() as conn:
            try:
                send_frame(conn, data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a server at its limit answers BUSY and hangs up unread: its answer is still there
            reply = pb.Reply()
            reply.ParseFromString(recv_frame(conn))
            return reply


def _served_within(running: _Running, seconds: float) -> bool:
    """Is a ping answered with a pong within ``seconds`` (BUSY answers retried)?"""
    deadline = time.monotonic() + seconds
    while True:
        try:
            reply = running.ask(_request(ping=pb.Ping()))
        except ConnectionResetError:
            # BUSY: the server at its limit hung up with our request unread, which may reset
            # the connection before its answer is read
            reply = pb.Reply(error=pb.Error(code=pb.BUSY))
        if reply.HasField("pong"):
            return True
        if reply.error.code != pb.BUSY or time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture
def serve(dynprof_dirs: dict[str, Path]) -> Iterator[Any]:
    started: list[_Running] = []

    def _serve(handlers: dict[str, Any], **kw: Any) -> _Running:
        path = str(dynprof_dirs["run"] / f"t{len(started)}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(8)
        server = ControlServer(sock, path, handlers, **kw)
        thread = threading.Thread(target=server.serve_forever, name="test-control-server", daemon=True)
        thread.start()
        running = _Running(server, thread, path)
        started.append(running)
        return running

    yield _serve
    for running in started:
        running.server.close()
        running.thread.join(5)


def test_a_request_over_the_socket_gets_its_handlers_answer(serve):
    # GIVEN a server with a ping handler
    running = serve({"ping": lambda _: ("pong", pb.Pong(dynprof_version="v1"))})

    # WHEN a client asks
    reply = running.ask(_request(request_id=11, ping=pb.Ping()))

    # THEN it gets the answer under its request id
    assert reply.request_id == 11 and reply.pong.dynprof_version == "v1"


def test_a_command_error_is_answered_with_its_code_message_and_help(serve):
    # GIVEN a handler that refuses
    def refuse(_: Any) -> Any:
        raise CommandError(pb.INVALID_ARGUMENT, "bad steps", "use --steps N")

    running = serve({"ping": refuse})

    # WHEN asked
    reply = running.ask(_request(ping=pb.Ping()))

    # THEN the error is the handler's own, structured
    assert (reply.error.code, reply.error.message, reply.error.help) == (
        pb.INVALID_ARGUMENT,
        "bad steps",
        "use --steps N",
    )


def test_a_client_that_sends_nothing_in_time_gets_an_error_and_frees_its_slot(serve):
    # GIVEN a server with one slot and a short request deadline
    running = serve({"ping": lambda _: ("pong", pb.Pong())}, max_connections=1, request_deadline=0.05)

    # WHEN a client connects and sends nothing
    with running.connect() as silent:
        reply = pb.Reply()
        reply.ParseFromString(recv_frame(silent))

    # THEN it is told its request was not complete in time, and the next client is served
    assert reply.error.code == pb.BAD_REQUEST and "not complete within" in reply.error.message
    assert running.server.noise.counts.get("a client did not send its request in time") == 1
    # (the slot is freed as the server's thread ends that connection, which may be a moment
    # after the client has read its answer: until then a new client is told BUSY)
    assert _served_within(running, 30.0), "the silent client's slot was never freed"


def test_an_oversized_request_is_refused_without_reading_it(serve):
    # GIVEN a server
    running = serve({"ping": lambda _: ("pong", pb.Pong())})

    # WHEN a client announces a frame bigger than a request may be
    with running.connect() as conn:
        conn.sendall(struct.pack(">I", MAX_REQUEST_BYTES + 1))
        reply = pb.Reply()
        reply.ParseFromString(recv_frame(conn))

    # THEN a structured "bad frame" error, noted for the log
    assert reply.error.code == pb.BAD_REQUEST and reply.error.message.startswith("bad frame")
    assert running.server.noise.counts.get("bad frame from a client") == 1


def test_a_handlers_failure_reaches_stderr_once_then_the_log_only(caplog):
    # GIVEN a status handler that always fails
    def broken(_: Any) -> Any:
        raise RuntimeError("handler bug")

    server = ControlServer(socket.socket(socket.AF_UNIX), "/nonexistent", {"status": broken})

    # WHEN asked three times
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        replies = [server.dispatch(_request(status=pb.StatusRequest())) for _ in range(3)]

    # THEN each request is answered INTERNAL, naming the command and the failure
    assert all(
        r.error.code == pb.INTERNAL and "status failed: RuntimeError: handler bug" in r.error.message for r in replies
    )
    # AND only the first was logged at a level the job's stderr shows; the later ones are counted
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "handler status failed" in loud[0].getMessage()
    assert server.failed_commands == {"status": 3}


def test_client_noise_sums_up_later_notes_once_an_interval_has_passed_and_at_flush(caplog):
    # GIVEN noise notes with no pause between summaries
    noise = ClientNoise(interval=0.0)

    # WHEN three notes of a kind come
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        for i in range(3):
            noise.note("bad frame", f"#{i}")
        noise.flush()

    # THEN the first is in full, each later one summed up with the latest detail, nothing left to flush
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("bad frame: #0")
    assert messages[1:] == [
        "bad frame: 1 more since the last note (latest: #1)",
        "bad frame: 1 more since the last note (latest: #2)",
    ]
    assert noise.counts == {"bad frame": 3}


def test_flush_logs_what_was_counted_but_not_yet_logged(caplog):
    # GIVEN notes within one interval (only the first logged)
    noise = ClientNoise(interval=3600.0)
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        for _ in range(4):
            noise.note("refused")

        # WHEN the agent stops
        noise.flush()

    # THEN the three held back are logged as a count
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and messages[1] == "refused: 3 more since the last note"


def test_close_ends_the_accept_loop_and_removes_the_socket(serve):
    # GIVEN a running server
    running = serve({})
    assert os.path.exists(running.path)

    # WHEN closed
    running.server.close()
    running.thread.join(5)

    # THEN its thread has ended and the socket file is gone
    assert not running.thread.is_alive()
    assert not os.path.exists(running.path)


def test_a_connection_no_thread_can_serve_is_answered_busy_and_the_client_gets_in_later(serve, monkeypatch):
    # GIVEN a server whose next two connection threads cannot start (a process out of threads)
    running = serve({"ping": lambda _: ("pong", pb.Pong(dynprof_version="v1"))})
    failures = [RuntimeError("can't start new thread")] * 2
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "dynprof-agent-conn" and failures:
            raise failures.pop()
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)

    # WHEN a client asks
    first = running.ask(_request(request_id=5, ping=pb.Ping()))

    # THEN it is not hung up on: BUSY for request 0, the answer clients retry on, and noted
    assert first.request_id == 0 and first.error.code == pb.BUSY, first
    assert "could not start serving" in first.error.message
    assert running.server.noise.counts.get("connection handling failed") == 1
    # AND asking again meets the second failed start, the same way; the one after that is served
    # at once (a failed start holds no slot)
    second = running.ask(_request(request_id=6, ping=pb.Ping()))
    assert second.request_id == 0 and second.error.code == pb.BUSY, second
    third = running.ask(_request(request_id=7, ping=pb.Ping()))
    assert third.request_id == 7 and third.pong.dynprof_version == "v1", third
    assert not failures and running.server.noise.counts.get("connection handling failed") == 2


def test_a_failure_while_serving_a_connection_is_answered_not_hung_up(serve, monkeypatch, caplog):
    # GIVEN a server whose connection handling fails before it reads the request
    running = serve({"ping": lambda _: ("pong", pb.Pong())})

    def broken(_conn: socket.socket) -> int:
        raise OSError(9, "Bad file descriptor (credentials unreadable)")

    monkeypatch.setattr(ControlServer, "_peer_uid", staticmethod(broken))

    # WHEN a client asks
    with caplog.at_level(logging.INFO, logger="dynprof.agent"):
        reply = running.ask(_request(ping=pb.Ping()))

    # THEN it reads an INTERNAL error for request 0 that points at the log; the details are
    # in the agent's log only
    assert reply.request_id == 0 and reply.error.code == pb.INTERNAL, reply
    assert reply.error.message == "the agent failed while serving this connection (see its log)"
    assert running.server.noise.counts.get("connection handling failed") == 1
    assert "connection handling failed: OSError: [Errno 9] Bad file descriptor (credentials unreadable)" in caplog.text
