"""dynprof.client: one request and one reply over an agent's Unix socket, against a scripted
agent; every wrong answer is the error a person can act on, never taken for an answer."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynprof import errors
from dynprof.client import AgentClient, AgentReplyError, error_from_reply, expected_reply
from dynprof.proto import PROTOCOL_VERSION, pb, recv_frame, send_frame
from dynprof.registry import AgentRecord, write_record
from tests.support.records import agent_record


@pytest.fixture
def agent(dynprof_dirs) -> Iterator[Callable[[Callable[[pb.Request], bytes | None]], str]]:
    """``agent(answer)``: a scripted agent on a Unix socket that answers each request with
    ``answer(request)`` (bytes to send as a frame; None: read and say nothing). Its socket path."""
    listeners: list[socket.socket] = []
    stop = threading.Event()
    held: list[socket.socket] = []

    def _agent(answer: Callable[[pb.Request], bytes | None]) -> str:
        path = str(dynprof_dirs["run"] / f"a{len(listeners)}.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(4)
        listeners.append(listener)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                request = pb.Request()
                request.ParseFromString(recv_frame(conn) or b"")
                data = answer(request)
                if data is None:
                    held.append(conn)  # keep it open, answer nothing
                    continue
                send_frame(conn, data)
                conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return path

    yield _agent
    stop.set()
    for s in listeners + held:
        s.close()


def _reply(request: pb.Request, **fields) -> bytes:
    reply = pb.Reply(request_id=request.request_id, **fields)
    return reply.SerializeToString()


def test_each_command_has_its_one_expected_reply():
    assert expected_reply("ping") == "pong"
    assert expected_reply("status") == "status"
    assert expected_reply("dump_stacks") == "artifact"
    with pytest.raises(TypeError, match="unknown command 'launch'"):
        expected_reply("launch")


def test_every_command_of_the_wire_expects_a_reply_of_the_wire_and_captures_their_artifact():
    from dynprof.client import _OWN_REPLY, expected_replies

    # GIVEN the wire's commands and replies
    commands = [f.name for f in pb.Request.DESCRIPTOR.oneofs_by_name["command"].fields]
    replies = {f.name for f in pb.Reply.DESCRIPTOR.oneofs_by_name["result"].fields}
    # THEN each command expects one reply the wire has, and a command named with its own reply is one of the wire's
    assert {expected_reply(name) for name in commands} <= replies
    assert set(_OWN_REPLY) <= set(commands)
    # AND the captures answer with the artifact they wrote, the others with their own reply
    artifact = {name for name in commands if expected_reply(name) == "artifact"}
    assert artifact == {"dump_stacks", "memory_snapshot", "memory_plan", "flight_recorder_dump"}
    assert expected_reply("memory_history") == "ack" and expected_reply("discover_nodes") == "job_nodes"
    # AND a new capture's command (a new field of Request) needs no row: it answers with its artifact
    assert expected_replies(["gc_pauses", "ping"]) == {"gc_pauses": "artifact", "ping": "pong"}


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (pb.BUSY, errors.Busy),
        (pb.NO_TORCH, errors.Unsupported),
        (pb.NO_CUDA, errors.Unsupported),
        (pb.INVALID_ARGUMENT, errors.UsageError),
    ],
)
def test_a_structured_error_becomes_its_exception_with_pid_message_code_and_help(code, cls):
    err = pb.Error(code=code, message="no can do", help="try this")
    exc = error_from_reply(42, err)
    assert type(exc) is cls
    assert str(exc) == f"pid 42: no can do [{pb.ErrorCode.Name(code)}]"
    assert exc.help == "try this" and exc.code == code  # type: ignore[attr-defined]


def test_an_error_code_this_client_does_not_know_is_an_agent_reply_error():
    exc = error_from_reply(7, pb.Error(code=9999, message="new"))
    assert isinstance(exc, AgentReplyError) and exc.code == 9999
    assert "[9999]" in str(exc) and exc.exit_code == 8


def test_the_request_carries_the_protocol_version_and_the_reply_is_returned(agent):
    seen: list[pb.Request] = []

    def answer(request: pb.Request) -> bytes:
        seen.append(request)
        return _reply(request, status=pb.Status(pid=1234, step=5))

    path = agent(answer)  # type: ignore[operator]
    status = AgentClient(pid=1234, sock_path=path, timeout=5).status()
    assert status.step == 5
    assert seen[0].protocol_version == PROTOCOL_VERSION and seen[0].HasField("status")


def test_a_reply_of_another_type_is_a_protocol_error(agent):
    path = agent(lambda r: _reply(r, pong=pb.Pong()))  # type: ignore[operator]
    with pytest.raises(
        errors.AgentError, match=r"answered pong to status \(expected status\): a protocol error"
    ) as info:
        AgentClient(pid=5, sock_path=path, timeout=5).status()
    assert "dynprof --version" in info.value.help


def test_a_reply_to_another_request_is_refused(agent):
    path = agent(lambda r: pb.Reply(request_id=r.request_id + 1, status=pb.Status()).SerializeToString())  # type: ignore[operator]
    with pytest.raises(errors.AgentError, match="answers another request"):
        AgentClient(pid=5, sock_path=path, timeout=5).status()


def test_an_unreadable_reply_is_an_agent_error(agent):
    path = agent(lambda r: b"\xff\xff\xff\xff")  # type: ignore[operator]
    with pytest.raises(errors.AgentError, match="unreadable reply from process 5"):
        AgentClient(pid=5, sock_path=path, timeout=5).status()


def test_an_error_reply_raises_or_is_returned_as_asked(agent):
    path = agent(lambda r: _reply(r, error=pb.Error(code=pb.BUSY, message="tracing")))  # type: ignore[operator]
    client = AgentClient(pid=9, sock_path=path, timeout=5)
    with pytest.raises(errors.Busy, match=r"pid 9: tracing \[BUSY\]"):
        client.status()
    reply = client.request(raise_on_error=False, status=pb.StatusRequest())
    assert reply.error.message == "tracing"


def test_an_agent_that_does_not_answer_in_time_is_a_timeout_that_points_at_stacks(agent):
    path = agent(lambda r: None)  # type: ignore[operator]
    with pytest.raises(errors.Timeout, match=r"did not answer within 0\.05 s") as info:
        AgentClient(pid=77, sock_path=path, timeout=0.05).status()
    assert "dynprof stacks --pid 77" in info.value.help


def test_a_dead_socket_is_no_agent(tmp_path):
    with pytest.raises(errors.NoAgent, match="no listening dynprof agent"):
        AgentClient(pid=5, sock_path=str(tmp_path / "gone.sock"), timeout=1).status()


def test_exactly_one_command_per_request(tmp_path):
    client = AgentClient(pid=5, sock_path=str(tmp_path / "x.sock"))
    with pytest.raises(TypeError, match="exactly one command"):
        client.request(ping=pb.Ping(), status=pb.StatusRequest())
    with pytest.raises(TypeError, match="exactly one command"):
        client.request()


def _record(pid: int, sock: str) -> AgentRecord:
    return agent_record(pid, socket=sock)


def test_for_pid_without_a_record_is_no_agent():
    with pytest.raises(errors.NoAgent, match=f"process {os.getpid()} has no dynprof agent"):
        AgentClient.for_pid(os.getpid())


def test_for_pid_with_a_record_whose_socket_is_gone_is_no_agent(tmp_path):
    write_record(_record(os.getpid(), str(tmp_path / "gone.sock")))
    with pytest.raises(errors.NoAgent, match="has no dynprof agent"):
        AgentClient.for_pid(os.getpid())


def test_for_pid_of_a_reused_pid_is_a_stale_record(tmp_path):
    sock = tmp_path / "s.sock"
    sock.touch()
    record = _record(os.getpid(), str(sock))
    record.start_ticks = 1  # another process's start time
    write_record(record)
    with pytest.raises(errors.NoAgent, match="stale record of an earlier process"):
        AgentClient.for_pid(os.getpid())


def test_for_pid_of_a_live_agent_uses_its_socket_and_timeout(tmp_path):
    sock = Path(tmp_path / "s.sock")
    sock.touch()
    write_record(_record(os.getpid(), str(sock)))
    client = AgentClient.for_pid(os.getpid(), timeout=3.0)
    assert (client.pid, client.sock_path, client.timeout) == (os.getpid(), str(sock), 3.0)


def test_for_pid_of_a_missing_process_is_not_found():
    with pytest.raises(errors.ProcessNotFound):
        AgentClient.for_pid(2**22 + 5)


def test_an_error_for_request_0_is_the_agents_word_on_our_unread_request(agent):
    # GIVEN an agent that could not read the request in time: it answers for request 0
    path = agent(  # type: ignore[operator]
        lambda r: pb.Reply(
            request_id=0, error=pb.Error(code=pb.BAD_REQUEST, message="request not complete within 2 s")
        ).SerializeToString()
    )
    client = AgentClient(pid=6, sock_path=path, timeout=60)  # answered at once; 60 s only if it is not

    # WHEN asked, THEN its message is the error (not "answers another request")
    with pytest.raises(errors.DynprofError, match=r"pid 6: request not complete within 2 s \[BAD_REQUEST\]"):
        client.status()
    # AND a caller that takes errors as replies gets the reply
    reply = client.request(raise_on_error=False, status=pb.StatusRequest())
    assert reply.request_id == 0 and reply.error.code == pb.BAD_REQUEST
