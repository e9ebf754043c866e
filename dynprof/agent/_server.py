"""The agent's control socket: one daemon thread in ``accept()``, one short-lived thread per request.

Each connection carries one request frame and gets one reply frame. Only peers with our uid
(or root) are served (SO_PEERCRED). The accept loop never reads from a client itself: each
accepted connection is read by its own daemon thread under a whole-request deadline, so a slow
or silent client holds one slot for at most ``REQUEST_DEADLINE_S`` and blocks nobody else. At
most ``MAX_CONNECTIONS`` connections are served at once; one more is answered at once with a
``BUSY`` error whose ``request_id`` is 0 (its request was never read) and closed, and clients
retry on that answer (as on the same answer when no thread could be started to serve it).
A connection is never closed without a reply unless its peer is another user: a failure while
serving it is answered ``INTERNAL`` for request 0. Handlers run one at a time, as they always have.

A malformed or oversized frame, an unknown command or a protocol version mismatch gets a
structured error reply or a closed connection. Bad clients are noted in the agent's log file
only (never in the job's output), the first of each kind in full, then a count at most once
every ``NOISE_INTERVAL_S``.

The socket is bound by the agent (no protobuf needed for that); this module, and
with it protobuf, is imported by the server thread itself, so a process's start-up pays for
neither.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from dynprof.proto import PROTOCOL_VERSION, FrameError, pb, recv_frame, send_frame
from dynprof.safetext import valid_text

log = logging.getLogger("dynprof.agent")

# A request is small; anything bigger than this is refused without reading it.
MAX_REQUEST_BYTES = 64 * 1024
# How long a client may take to send its whole request before the agent hangs up.
REQUEST_DEADLINE_S = 2.0
# How long the agent tries to hand a reply to a client that does not read it.
REPLY_DEADLINE_S = 10.0
# Connections served at the same time; more are answered BUSY and closed.
MAX_CONNECTIONS = 16
# Bad-client notes after the first of a kind are counted and logged at most this often.
NOISE_INTERVAL_S = 60.0

Handler = Callable[[Any], tuple[str, Any]]


class CommandError(Exception):
    """Raised by a handler to answer with a structured error."""

    def __init__(self, code: int, message: str, help: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.help = help


class ClientNoise:
    """Notes about misbehaving clients, for the agent's log file only (INFO: below the level the
    job's stderr shows). The first note of each kind is logged in full; later ones are counted and
    summed up at most once every ``interval`` seconds, so a flood of bad connections costs the
    job neither output nor log space."""

    def __init__(self, interval: float = NOISE_INTERVAL_S) -> None:
        self.interval = interval
        self.counts: dict[str, int] = {}  # every note seen, by kind (for tests and status)
        self._pending: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, kind: str, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind not in self._last:
                self._last[kind] = now
                message = f"{kind}: {detail}" if detail else kind
                suffix = f" (more of these are counted and logged every {self.interval:g} s)"
            else:
                self._pending[kind] = self._pending.get(kind, 0) + 1
                if now - self._last[kind] < self.interval:
                    return
                count, self._pending[kind] = self._pending[kind], 0
                self._last[kind] = now
                message = f"{kind}: {count} more since the last note"
                suffix = f" (latest: {detail})" if detail else ""
        log.info("%s%s", message, suffix)

    def flush(self) -> None:
        """Log the counts not yet logged (when the agent stops)."""
        with self._lock:
            pending = {k: n for k, n in self._pending.items() if n}
            self._pending.clear()
        for kind, count in pending.items():
            log.info("%s: %d more since the last note", kind, count)


class ControlServer:
    def __init__(
        self,
        sock: socket.socket,
        path: str,
        handlers: dict[str, Handler],
        max_connections: int = MAX_CONNECTIONS,
        request_deadline: float = REQUEST_DEADLINE_S,
    ) -> None:
        self.path = path
        self.handlers = handlers
        self.max_connections = max_connections
        self.request_deadline = request_deadline
        self.noise = ClientNoise()
        self._sock: socket.socket | None = sock
        self._closing = False
        self._slots = threading.BoundedSemaphore(max_connections)
        self._dispatch_lock = threading.Lock()
        self.failed_commands: dict[str, int] = {}  # handler failures by command

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(Exception):
            self.noise.flush()
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
            except OSError as exc:
                if self._closing or exc.errno == errno.EBADF:
                    return  # closed (by the agent's stop): nothing will ever be accepted again
                # Out of file descriptors, say: note it and give the process a moment.
                self.noise.note("accept failed", str(exc))
                time.sleep(0.05)
                continue
            try:
                self._start_connection(conn)
            except Exception as exc:
                # No thread to serve it (the process is out of threads or memory, say): answer
                # BUSY for request 0, as at the connection limit, so the client asks again
                # instead of reading a hang-up.
                self.noise.note("connection handling failed", f"{type(exc).__name__}: {exc}")
                self._reply_error(
                    conn, 0, pb.BUSY, "the agent could not start serving this connection; retry shortly", timeout=0.0
                )
                with contextlib.suppress(OSError):
                    conn.close()

    def _start_connection(self, conn: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            self.noise.note("connection refused, too many at once", f"limit {self.max_connections}")
            # A fresh connection's send buffer is empty: this small frame goes out without waiting.
            self._reply_error(
                conn,
                0,
                pb.BUSY,
                f"the agent is serving {self.max_connections} connections already; retry shortly",
                timeout=0.0,
            )
            conn.close()
            return
        try:
            thread = threading.Thread(
                target=self._serve_connection, args=(conn,), name="dynprof-agent-conn", daemon=True
            )
            thread.start()
        except BaseException:
            self._slots.release()
            raise

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            self._handle_connection(conn)
        except Exception as exc:
            # Every path of _handle_connection that sends a reply catches its own errors, so
            # nothing was sent: say so (the details go to the agent's log, not to the peer).
            self.noise.note("connection handling failed", f"{type(exc).__name__}: {exc}")
            self._reply_error(conn, 0, pb.INTERNAL, "the agent failed while serving this connection (see its log)")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self._slots.release()

    @staticmethod
    def _peer_uid(conn: socket.socket) -> int:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)

    def _handle_connection(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.request_deadline
        uid = self._peer_uid(conn)
        if uid != os.getuid() and uid != 0:
            self.noise.note("refused a connection from another user", f"uid {uid}")
            return
        try:
            data = recv_frame(conn, max_bytes=MAX_REQUEST_BYTES, deadline=deadline)
        except TimeoutError:
            self.noise.note("a client did not send its request in time", f"deadline {self.request_deadline:g} s")
            self._reply_error(conn, 0, pb.BAD_REQUEST, f"request not complete within {self.request_deadline:g} s")
            return
        except (FrameError, OSError) as exc:
            self.noise.note("bad frame from a client", str(exc))
            self._reply_error(conn, 0, pb.BAD_REQUEST, f"bad frame: {exc}")
            return
        with self._dispatch_lock:
            reply = self.dispatch(data)
        try:
            payload = reply.SerializeToString()
        except Exception as exc:  # never hang up without an answer
            self.noise.note("could not encode a reply", f"{type(exc).__name__}: {exc}")
            payload = self._error(0, pb.INTERNAL, f"the agent could not encode its reply: {exc}").SerializeToString()
        conn.settimeout(REPLY_DEADLINE_S)  # sendall: a bound on the whole reply
        try:
            send_frame(conn, payload)
        except (OSError, FrameError) as exc:
            self.noise.note("could not send a reply", str(exc))

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
            reply = pb.Reply(protocol_version=PROTOCOL_VERSION, request_id=req.request_id)
            getattr(reply, field).CopyFrom(result)  # a handler's wrong answer is its failure, answered
        except CommandError as exc:
            return self._error(req.request_id, exc.code, exc.message, exc.help)
        except Exception as exc:
            self._handler_failed(command)
            return self._error(
                req.request_id,
                pb.INTERNAL,
                f"{command} failed: {type(exc).__name__}: {exc}",
                "See the agent log in the dynprof runtime directory (logs/PID.log).",
            )
        return reply

    def _handler_failed(self, command: str) -> None:
        """A handler's failure goes into the job's stderr once per command, the first time, with
        where the rest go; every later one of that command goes to the agent's log file only
        (a client polling ``status`` every second must not write a line a second into the job's
        output). Called under the dispatch lock: handlers run one at a time."""
        first = command not in self.failed_commands
        self.failed_commands[command] = self.failed_commands.get(command, 0) + 1
        if first:
            log.exception("handler %s failed (its later failures go to the agent's log file only)", command)
        else:
            log.info("handler %s failed again (%d times)", command, self.failed_commands[command], exc_info=True)

    @staticmethod
    def _error(request_id: int, code: int, message: str, help: str = "") -> Any:
        reply = pb.Reply(protocol_version=PROTOCOL_VERSION, request_id=request_id)
        reply.error.code = code
        reply.error.message = valid_text(message)
        reply.error.help = valid_text(help)
        return reply

    def _reply_error(self, conn: socket.socket, request_id: int, code: int, message: str, timeout: float = 0.5) -> None:
        with contextlib.suppress(OSError, FrameError):
            conn.settimeout(timeout)  # the client may not read: never wait long on it
            send_frame(conn, self._error(request_id, code, message).SerializeToString())
