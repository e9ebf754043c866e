"""The agent's control socket: one daemon thread blocked in ``accept()``.

Each connection carries one request frame and gets one reply frame. Only peers with our uid
(or root) are served (SO_PEERCRED). A malformed or oversized frame, an unknown command or a
protocol version mismatch gets a structured error reply or a closed connection; the thread
goes back to ``accept()`` whatever happens.

The socket is bound by the agent (no protobuf needed for that); this module, and
with it protobuf, is imported by the server thread itself, so a process's start-up pays for
neither.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from dynprof.proto import PROTOCOL_VERSION, FrameError, pb, recv_frame, send_frame

log = logging.getLogger("dynprof.agent")

# A request is small; anything bigger than this is refused without reading it.
MAX_REQUEST_BYTES = 64 * 1024
# How long a client may take to send its request before the agent hangs up.
REQUEST_TIMEOUT_S = 2.0

Handler = Callable[[Any], tuple[str, Any]]


class CommandError(Exception):
    """Raised by a handler to answer with a structured error."""

    def __init__(self, code: int, message: str, help: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.help = help


class ControlServer:
    def __init__(self, sock: socket.socket, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self.handlers = handlers
        self.requests_served = 0
        self._sock: socket.socket | None = sock
        self._closing = False

    def close(self) -> None:
        self._closing = True
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def serve_forever(self) -> None:
        while not self._closing:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                if self._closing:
                    return
                log.exception("accept failed")
                continue
            try:
                self._handle_connection(conn)
            except Exception:
                log.exception("connection handling failed")
            finally:
                with contextlib.suppress(OSError):
                    conn.close()

    @staticmethod
    def _peer_uid(conn: socket.socket) -> int:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)

    def _handle_connection(self, conn: socket.socket) -> None:
        uid = self._peer_uid(conn)
        if uid != os.getuid() and uid != 0:
            log.warning("refused a connection from uid %d", uid)
            return
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            data = recv_frame(conn, max_bytes=MAX_REQUEST_BYTES)
        except (FrameError, OSError) as exc:
            log.warning("bad frame from a client: %s", exc)
            self._reply_error(conn, 0, pb.BAD_REQUEST, f"bad frame: {exc}")
            return
        reply = self.dispatch(data)
        conn.settimeout(10.0)
        try:
            send_frame(conn, reply.SerializeToString())
        except (OSError, FrameError) as exc:
            log.warning("could not send a reply: %s", exc)
        self.requests_served += 1

    def dispatch(self, data: bytes) -> Any:
        req = pb.Request()
        try:
            req.ParseFromString(data)
        except Exception as exc:
            return self._error(0, pb.BAD_REQUEST, f"not a dynprof request: {exc}")
        if req.protocol_version != PROTOCOL_VERSION:
            return self._error(
                req.request_id,
                pb.VERSION_MISMATCH,
                f"protocol version {req.protocol_version} is not supported (agent speaks {PROTOCOL_VERSION})",
                "Use the same dynprof version for the CLI and the job.",
            )
        command = req.WhichOneof("command")
        if command is None:
            return self._error(req.request_id, pb.BAD_REQUEST, "request carries no command (unknown to this agent?)")
        handler = self.handlers.get(command)
        if handler is None:
            return self._error(
                req.request_id, pb.UNKNOWN_COMMAND, f"command {command!r} is not available in this agent"
            )
        try:
            field, result = handler(getattr(req, command))
        except CommandError as exc:
            return self._error(req.request_id, exc.code, exc.message, exc.help)
        except Exception as exc:
            log.exception("handler %s failed", command)
            return self._error(
                req.request_id,
                pb.INTERNAL,
                f"{command} failed: {type(exc).__name__}: {exc}",
                "See the agent log in the dynprof runtime directory (logs/PID.log).",
            )
        reply = pb.Reply(protocol_version=PROTOCOL_VERSION, request_id=req.request_id)
        getattr(reply, field).CopyFrom(result)
        return reply

    @staticmethod
    def _error(request_id: int, code: int, message: str, help: str = "") -> Any:
        reply = pb.Reply(protocol_version=PROTOCOL_VERSION, request_id=request_id)
        reply.error.code = code
        reply.error.message = message
        reply.error.help = help
        return reply

    def _reply_error(self, conn: socket.socket, request_id: int, code: int, message: str) -> None:
        with contextlib.suppress(OSError, FrameError):
            send_frame(conn, self._error(request_id, code, message).SerializeToString())
