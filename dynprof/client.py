"""Talking to an agent: one request, one reply, over the agent's Unix socket."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dynprof import errors
from dynprof.proto import PROTOCOL_VERSION, FrameError, pb, recv_frame, send_frame
from dynprof.registry import AgentRecord, read_record, socket_path

_ids = itertools.count(1)
# Pauses between attempts to reach an agent whose connection queue is full.
_FIRST_RETRY_PAUSE_S = 0.02
_MAX_RETRY_PAUSE_S = 0.5

# Structured error codes from the wire -> the exception a person sees. Never match on text.
_ERROR_CLASSES: dict[int, type[errors.DynprofError]] = {
    pb.BUSY: errors.Busy,
    pb.PROFILER_ACTIVE: errors.Busy,
    pb.NO_TORCH: errors.Unsupported,
    pb.NO_CUDA: errors.Unsupported,
    pb.UNSUPPORTED: errors.Unsupported,
    pb.NOT_RUNNING: errors.DynprofError,
    pb.INVALID_ARGUMENT: errors.UsageError,
}


# The reply each command calls for. A reply of any other type (an agent of another version, or
# something else listening on the socket) is a protocol error, never taken for an answer. A
# command of the wire (a field of Request's ``command``) answers with the artifact it wrote
# (``ArtifactWritten``), as a capture does, unless it is named here with its own reply.
_OWN_REPLY: dict[str, str] = {
    "ping": "pong",
    "status": "status",
    "start_trace": "trace_started",
    "stop_trace": "trace_stopped",
    "memory_history": "ack",
    "discover_nodes": "job_nodes",
}
ARTIFACT_REPLY = "artifact"


def expected_replies(commands: Iterable[str]) -> dict[str, str]:
    """The reply each of ``commands`` (the wire's command names) calls for."""
    return {name: _OWN_REPLY.get(name, ARTIFACT_REPLY) for name in commands}


_EXPECTED_REPLY: dict[str, str] = expected_replies(
    field.name for field in pb.Request.DESCRIPTOR.oneofs_by_name["command"].fields
)


def expected_reply(command: str) -> str:
    """The Reply field that answers ``command`` (a Request field name)."""
    try:
        return _EXPECTED_REPLY[command]
    except KeyError:
        raise TypeError(f"unknown command {command!r}") from None


class AgentReplyError(errors.AgentError):
    """The agent answered with a structured error; ``code`` is the wire's ErrorCode."""

    def __init__(self, code: int, message: str, help: str | None = None) -> None:
        super().__init__(message, help)
        self.code = code


def error_from_reply(pid: int, err: Any) -> errors.DynprofError:
    cls = _ERROR_CLASSES.get(err.code)
    name = pb.ErrorCode.Name(err.code) if err.code in pb.ErrorCode.values() else str(err.code)
    message = f"pid {pid}: {err.message} [{name}]"
    if cls is None:
        return AgentReplyError(err.code, message, err.help or None)
    exc = cls(message, err.help or None)
    exc.code = err.code  # type: ignore[attr-defined]
    return exc


@dataclass
class AgentClient:
    pid: int
    sock_path: str
    timeout: float = 5.0

    @classmethod
    def for_pid(cls, pid: int, timeout: float = 5.0) -> AgentClient:
        """Client for ``pid``, raising a precise error when there is no agent to talk to."""
        errors.probe_pid(pid)
        record = read_record(pid)
        path = record.socket if record is not None else str(socket_path(pid))
        if record is None or not os.path.exists(path):
            raise errors.NoAgent(f"process {pid} has no dynprof agent")
        if record.pid != pid or not record.is_alive():
            raise errors.NoAgent(f"process {pid} has no dynprof agent (stale record of an earlier process)")
        return cls(pid=pid, sock_path=path, timeout=timeout)

    @classmethod
    def for_record(cls, record: AgentRecord, timeout: float = 5.0) -> AgentClient:
        return cls(pid=record.pid, sock_path=record.socket, timeout=timeout)

    def request(self, raise_on_error: bool = True, **command: Any) -> Any:
        """Send one command (``status=pb.StatusRequest()``...) and return the Reply.

        An agent whose connection queue is full (the kernel's backlog, or the agent's own limit
        on connections served at once) is asked again with a growing pause, for up to
        ``timeout`` seconds; then :class:`~dynprof.errors.Busy` says so."""
        if len(command) != 1:
            raise TypeError("exactly one command")
        ((name, message),) = command.items()
        wanted = expected_reply(name)
        req = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=next(_ids) + os.getpid() * 1_000_000)
        getattr(req, name).CopyFrom(message)
        payload = req.SerializeToString()
        deadline = time.monotonic() + self.timeout
        pause = _FIRST_RETRY_PAUSE_S
        attempts = 0
        while True:
            attempts += 1
            data = self._exchange(payload)
            reply = pb.Reply()
            try:
                reply.ParseFromString(b"" if data is None else data)
            except Exception as exc:  # protobuf raises DecodeError, a private subclass
                raise errors.AgentError(f"unreadable reply from process {self.pid}: {exc}") from None
            # No answer (a full backlog), or BUSY for request 0: the agent did not read our request
            # because it serves too many connections. Anything else is the answer.
            crowded = data is None or (
                reply.request_id == 0 and reply.HasField("error") and reply.error.code == pb.BUSY
            )
            if not crowded:
                break
            if time.monotonic() + pause > deadline:
                raise errors.Busy(
                    f"the agent of process {self.pid} is not taking connections: its queue stayed full "
                    f"for {self.timeout:g} s ({attempts} attempts)",
                    help="Too many clients are talking to it at once (or something floods its socket). "
                    "Try again in a moment; `dynprof ps` shows whether the process is still running.",
                )
            time.sleep(pause)
            pause = min(pause * 2, _MAX_RETRY_PAUSE_S)
        if reply.request_id != req.request_id:
            if reply.request_id == 0 and reply.HasField("error"):
                # The agent could not read our request (it came too slowly, or was not a frame)
                # and says why: that message, not "another request", is what to show.
                if raise_on_error:
                    raise error_from_reply(self.pid, reply.error)
                return reply
            raise errors.AgentError(f"reply from process {self.pid} answers another request")
        if reply.HasField("error"):
            if raise_on_error:
                raise error_from_reply(self.pid, reply.error)
            return reply
        got = reply.WhichOneof("result")
        if got != wanted:
            raise errors.AgentError(
                f"the agent of process {self.pid} answered {got or 'nothing'} to {name} (expected {wanted}): "
                "a protocol error",
                help="The process may run another dynprof version, or something else listens on its socket: "
                "compare `dynprof ps` with this CLI's version (`dynprof --version`).",
            )
        return reply

    def _exchange(self, payload: bytes) -> bytes | None:
        """One connection: send the request, return the reply frame, or None when the agent's
        connection queue is full (connect would block)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            try:
                sock.connect(self.sock_path)
            except BlockingIOError:
                return None  # EAGAIN: the listening socket's backlog is full
            except (FileNotFoundError, ConnectionRefusedError):
                raise errors.NoAgent(
                    f"process {self.pid} has no listening dynprof agent (socket {self.sock_path} is dead)"
                ) from None
            except PermissionError:
                raise errors.PermissionDenied(f"cannot connect to the agent of process {self.pid}") from None
            except OSError as exc:
                raise errors.AgentError(f"cannot connect to the agent of process {self.pid}: {exc}") from None
            try:
                send_frame(sock, payload)
            except (BrokenPipeError, ConnectionResetError):
                # An agent at its connection limit answers BUSY and hangs up without reading:
                # that answer may be waiting for us even though our request could not go out.
                pass
            return recv_frame(sock)
        except TimeoutError:
            raise errors.Timeout(
                f"the agent of process {self.pid} did not answer within {self.timeout:g} s",
                help="The process may be stuck holding the GIL; try `dynprof stacks --pid "
                f"{self.pid}`, which reads it from outside.",
            ) from None
        except (FrameError, ConnectionResetError, BrokenPipeError) as exc:
            raise errors.AgentError(f"the agent of process {self.pid} broke the connection: {exc}") from None
        finally:
            sock.close()

    def status(self) -> Any:
        return self.request(status=pb.StatusRequest()).status
