"""The sidecar's HTTP server: cheroot's threaded WSGI server, held against hostile clients.

cheroot gives each connection to one of a fixed number of worker threads, which then blocks
reading it; its timeout bounds each read, not a request, so a client dripping a byte every few
seconds holds a worker for ever, and as many such clients as workers (no token needed) stop
the server. Here:

- A new plain-HTTP connection waits in cheroot's selector, holding no worker, until its whole
  request head has arrived (looked at every ``PARK_S`` seconds while it drips in); one that
  sends nothing is closed after the idle timeout, one whose head is not in after
  ``head_timeout`` is closed. Under TLS the head cannot be looked at before decryption: the
  connection goes to a worker once its first bytes (the TLS hello) came, and the worker, not
  cheroot's one accepting thread, does the handshake, under the head deadline.
- Whole-request deadlines, before any check of the app: a worker that takes a connection
  gets its request line and headers within ``head_timeout`` seconds, then the body within
  ``body_timeout``, or answers 408 and closes, however slowly the bytes drip.
- A Content-Length that is not digits (``-1``, ``+5``, ``0x10``) is 400 and the connection
  closed: cheroot would take ``-1`` as "read until the client closes".
- ``GET /healthz`` arriving whole on a new plain-HTTP connection is answered by the selector
  thread itself, with the app's own answer (computed once at start), before the worker pool:
  no state of the workers (slow clients, token holders' slow renders or downloads, actions)
  can delay a readiness probe. Under TLS the request cannot be read there; it goes to the
  workers (the deadlines above still bound what a client without the token can hold).
- ``Reserve`` keeps a thread free of long requests: at most threads - 1 requests in the app.
- cheroot's error log is one line per event, no traceback, rate-limited (``RefusalLog``).
- Open connections are bounded below the open-file limit (``max_connections``, from
  :func:`connection_cap`): a new one past the cap is closed at once, but for ``HEALTHZ_LANE``
  of them at a time, kept at most ``PROBE_GRACE_S`` for a whole ``GET /healthz`` and then
  answered; one whose first bytes are those of another request is closed unanswered at once
  (plain HTTP: the early answer above). A readiness probe is answered while a flood holds every
  connection (one of silent clients or of /healthz heads cut short still holds the lane's places,
  each for ``PROBE_GRACE_S`` at most); a connection whose head
  is not in is closed at ``head_timeout`` whether it sends or not, and one whose client has
  closed before sending a request is closed by the selector itself (no worker). A failed
  accept for want of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) pauses accepting for
  ``ACCEPT_BACKOFF_S`` instead of failing again at once; an episode of either (the cap, or
  descriptors) is logged in one line when it begins and one when it ends, with its counts.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import heapq
import itertools
import resource
import select
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from cheroot.connections import ConnectionManager
from cheroot.errors import FatalSSLAlert
from cheroot.makefile import MakeFile, StreamReader
from cheroot.server import HTTPConnection, HTTPRequest
from cheroot.ssl.builtin import BuiltinSSLAdapter
from cheroot.wsgi import Server
from werkzeug.wsgi import ClosingIterator

from dynprof.sidecar.guard import RefusalLog

HEALTHZ_REQUEST = b"GET /healthz HTTP/1."
_CLOSED = b"\0closed"  # _peek_head: the client closed (or its socket failed) before a request
PARK_S = 0.5  # a connection whose head is not all in is looked at again after this
MAX_PARKED = 4096
_PEEK_BYTES = 16384
ACCEPT_BACKOFF_S = 0.5  # accepting pauses this long after an accept failed for want of descriptors
EPISODE_QUIET_S = 2.0  # a shedding episode ends after this long without a shed connection
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
MIN_CONNECTIONS = 16
HEALTHZ_LANE = 8
"""Connections past the cap kept, at once, for a /healthz (descriptors of :func:`descriptor_reserve`'s 64)."""
PROBE_GRACE_S = 2.0  # a connection of the /healthz lane whose head is not in by then is closed


def descriptor_reserve(threads: int) -> int:
    """Descriptors kept free of connections: the listening socket, the selector, logs, the
    agents' sockets, the ``HEALTHZ_LANE`` probes past the cap, and the actions' pipes and files
    (per worker thread)."""
    return 64 + 8 * threads


def min_open_files(threads: int) -> int:
    """The smallest open-file limit that leaves ``threads`` workers room for connections."""
    return descriptor_reserve(threads) + MIN_CONNECTIONS


def connection_cap(threads: int, limit: int | None = None) -> int:
    """The most connections held at once: the soft open-file limit (``limit``, default this
    process's) less :func:`descriptor_reserve`, never under ``MIN_CONNECTIONS``."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        limit = 1 << 20
    return max(MIN_CONNECTIONS, int(limit) - descriptor_reserve(threads))


def raise_open_file_limit(wanted: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE of this process to ``wanted`` (at most the hard limit;
    never lowered); (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def _peer_hung_up(sock: Any) -> bool:
    """Whether the client has closed its side (Linux POLLRDHUP; False where unknown)."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if not rdhup:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), rdhup)
        return any(events & (rdhup | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


class _Parking:
    """Connections whose request head has not all come, each handed back to ``wake`` (the
    server's selector) at its time: a slow head holds a file descriptor, never a worker."""

    def __init__(self, wake: Callable[[Any], None]) -> None:
        self._wake = wake
        self._heap: list[tuple[float, int, Any]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def park(self, conn: Any, at: float) -> bool:
        with self._cv:
            if len(self._heap) >= MAX_PARKED:
                return False
            heapq.heappush(self._heap, (at, next(self._seq), conn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dynprof-serve-parking", daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, conn = heapq.heappop(self._heap)
            try:
                self._wake(conn)
            except Exception:  # a connection closed meanwhile: it is dropped
                with contextlib.suppress(Exception):
                    conn.close()


class _DeadlineSocketIO(socket.SocketIO):
    """A socket's reader that gives up at ``deadline`` (time.monotonic()), not just after an
    idle read: each read waits at most what is left."""

    deadline: float | None = None

    def readinto(self, b: Any) -> int | None:
        if self.deadline is None:
            return super().readinto(b)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")  # cheroot answers 408 to this message
        sock = self._sock  # type: ignore[attr-defined]
        idle = sock.gettimeout()
        sock.settimeout(left if idle is None else min(idle, left))
        try:
            return super().readinto(b)
        finally:
            sock.settimeout(idle)


class _DeadlineReader(StreamReader):  # type: ignore[misc]
    def __init__(self, sock: Any, bufsize: int = 8192) -> None:
        self._deadline_io = _DeadlineSocketIO(sock, "rb")
        super(StreamReader, self).__init__(self._deadline_io, bufsize)  # StreamReader's, with this raw reader
        self.bytes_read = 0

    def set_deadline(self, seconds: float | None) -> None:
        self._deadline_io.deadline = None if seconds is None else time.monotonic() + seconds


class _Request(HTTPRequest):  # type: ignore[misc]
    def read_request_headers(self) -> bool:
        if not super().read_request_headers():  # type: ignore[no-untyped-call]
            return False
        length = self.inheaders.get(b"Content-Length")
        if length is not None and not (length.isdigit() and length.isascii()):
            self.simple_response("400 Bad Request", "Malformed Content-Length Header.")
            self.close_connection = True
            return False
        self.conn.rfile.set_deadline(self.server.body_timeout)
        return True

    def send_headers(self) -> None:
        # a body left unread (a 401 answered before it, a 408 while it dripped) would be
        # parsed as the next request: close instead
        body = self.rfile
        unread = getattr(body, "remaining", 0) > 0 or (self.chunked_read and not getattr(body, "closed", True))
        if unread or int(self.status[:3]) == 408:
            self.close_connection = True
        super().send_headers()


class _Connection(HTTPConnection):  # type: ignore[misc]
    RequestHandlerClass = _Request
    accepted_at: float | None = None  # when it was accepted (time.monotonic()); None: not yet seen
    served = False  # a worker has read a request of it
    probe_only = False  # taken past the cap, in the /healthz lane: answered only if it is a /healthz

    def __init__(self, server: Any, sock: Any, makefile: Callable[..., Any] = MakeFile) -> None:
        def files(s: Any, mode: str = "r", bufsize: int = 8192) -> Any:
            return _DeadlineReader(s, bufsize) if "r" in mode else makefile(s, mode, bufsize)

        super().__init__(server, sock, files)
        self._counted = hasattr(server, "held") and server.held(+1)

    def close(self) -> None:
        if self.probe_only:  # its place is free before its client sees the close
            self.probe_only = False
            self.server.lane(-1)
        try:
            super().close()
        finally:
            if self._counted:
                self._counted = False
                self.server.held(-1)

    def communicate(self) -> bool:
        self.served = True
        if isinstance(self.socket, ssl.SSLSocket) and not self.tls_ready and not self._handshake():
            return False
        self.rfile.set_deadline(self.server.head_timeout)
        try:
            return bool(super().communicate())  # type: ignore[no-untyped-call]
        finally:
            self.rfile.set_deadline(None)  # a kept-alive connection idles under the idle timeout

    tls_ready = False

    def _handshake(self) -> bool:
        """The TLS handshake, here in a worker under the head deadline (cheroot does it in its
        one accepting thread, which a client that never says hello then holds)."""
        sock = self.socket
        idle = sock.gettimeout()
        sock.settimeout(self.server.head_timeout)
        try:
            sock.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self.server.log.say(f"dynprof serve: TLS handshake with {self.remote_addr} failed: {exc}"[:300])
            return False
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(idle)
        self.tls_ready = True
        self.ssl_env = self.server.ssl_adapter.get_environ(sock)
        return True


class LazyHandshakeSSLAdapter(BuiltinSSLAdapter):  # type: ignore[misc]
    """cheroot's TLS adapter, but the handshake is left to the connection's worker."""

    def wrap(self, sock: Any) -> tuple[Any, dict[str, Any]]:
        try:
            wrapped = self.context.wrap_socket(sock, do_handshake_on_connect=False, server_side=True)
        except OSError as exc:
            raise FatalSSLAlert(*exc.args) from exc
        return wrapped, {}


class _Connections(ConnectionManager):  # type: ignore[misc]
    """cheroot's selector loop, held to the sidecar's bounds: an accept that fails for want of
    descriptors pauses accepting (cheroot would raise it out of its loop, which then fails on
    the same pending connection at once, never reaching its expiry: dead for good), and new
    connections whose head is not in by the head deadline (the /healthz lane's: by
    ``PROBE_GRACE_S``) are closed."""

    _selector: Any  # cheroot's own (not in its stubs)

    def __init__(self, server: Any) -> None:
        super().__init__(server)
        self._paused_until: float | None = None

    def _from_server_socket(self, server_socket: Any) -> Any:
        try:
            return super()._from_server_socket(server_socket)  # type: ignore[misc]
        except OSError as exc:
            if exc.errno not in OUT_OF_DESCRIPTORS:
                raise
            self._selector.unregister(server_socket.fileno())
            self._paused_until = time.monotonic() + ACCEPT_BACKOFF_S
            self.server.shed("accept", exc)
            return None

    def _expire(self, threshold: float) -> None:
        super()._expire(threshold)  # type: ignore[misc]
        now = time.monotonic()
        late = [
            (fd, conn)
            for fd, conn in self._selector.connections
            if conn is not self.server
            and not conn.served
            and conn.accepted_at is not None
            and now - conn.accepted_at > (PROBE_GRACE_S if conn.probe_only else self.server.head_timeout)
        ]
        for fd, conn in late:
            self._selector.unregister(fd)
            conn.close()
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._selector.register(self.server.socket.fileno(), selectors.EVENT_READ, data=self.server)
        self.server.episode_tick()


class SidecarServer(Server):  # type: ignore[misc]
    """cheroot's WSGI server with the deadlines, the early /healthz and the quiet error log
    described above. ``healthz`` is the whole HTTP answer to ``GET /healthz`` (None: the
    workers answer it)."""

    ConnectionClass = _Connection
    _connections: Any  # cheroot's connection manager, made by prepare()

    def __init__(
        self,
        *args: Any,
        head_timeout: float,
        body_timeout: float,
        healthz: bytes | None = None,
        log: RefusalLog | None = None,
        max_connections: int = 1024,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.healthz = healthz
        self.log = log or RefusalLog()
        self.max_connections = max_connections
        self._parking = _Parking(self.put_conn)
        self._held = 0
        self._lane = 0  # connections in the /healthz lane
        self._held_lock = threading.Lock()
        self._episode: dict[str, Any] | None = None  # a shedding episode under way: its counts

    def prepare(self) -> None:
        super().prepare()
        made = self._connections
        self._connections = _Connections(self)
        made.close()  # the one cheroot made holds nothing yet: only its selector is closed

    def held(self, delta: int) -> bool:
        """Count a connection opened (+1) or closed (-1)."""
        with self._held_lock:
            self._held += delta
        return True

    def lane(self, delta: int) -> bool:
        """Take (+1: whether a place was free) or give back (-1) a place in the /healthz lane."""
        with self._held_lock:
            if delta > 0 and self._lane >= HEALTHZ_LANE:
                return False
            self._lane += delta
        return True

    @property
    def connections_held(self) -> int:
        return self._held

    def shed(self, why: str, exc: BaseException | None = None) -> None:
        """A connection shed (``why`` "cap": closed at once past the cap; "accept": an accept
        that failed for want of descriptors); the episode's first says so, once."""
        now = time.monotonic()
        episode = self._episode
        if episode is None:
            episode = self._episode = {"began": now, "cap": 0, "accept": 0}
            what = (
                f"out of file descriptors ({exc}); accepting pauses {ACCEPT_BACKOFF_S:g} s at a time"
                if why == "accept"
                else f"{self._held} connections held, at the cap of {self.max_connections}; new ones are closed"
            )
            self.log.say(f"dynprof serve: shedding connections: {what} (connections whose head is not in "
                         f"are closed after {self.head_timeout:g} s)")  # fmt: skip
        episode[why] += 1
        episode["last"] = now

    def episode_tick(self) -> None:
        """End the shedding episode (one line with its counts) once it has been quiet a while."""
        episode = self._episode
        if episode is None or time.monotonic() - episode["last"] < EPISODE_QUIET_S:
            return
        self._episode = None
        self.log.say(
            f"dynprof serve: no longer shedding connections ({self._held} held): in "
            f"{episode['last'] - episode['began']:.1f} s, {episode['cap']} closed past the cap, "
            f"{episode['accept']} accepts failed for want of descriptors"
        )

    def process_conn(self, conn: Any) -> None:
        if conn.served:
            super().process_conn(conn)
            return
        now = time.monotonic()
        if conn.accepted_at is None:  # new: into the selector, a worker only once its head is in
            conn.accepted_at = now
            if self._held > self.max_connections:
                if self.healthz is None or self.ssl_adapter is not None or not self.lane(+1):
                    self.shed("cap")
                    conn.close()
                    return
                conn.probe_only = True  # past the cap: kept a moment, for a /healthz only
            self.put_conn(conn)
            return
        if self.ssl_adapter is not None:  # its first bytes (a TLS hello) came: the worker shakes hands
            super().process_conn(conn)
            return
        head = self._peek_head(conn)
        if head is None:  # not all there yet: look again later, holding no worker
            limit = min(self.head_timeout, PROBE_GRACE_S) if conn.probe_only else self.head_timeout
            late = now - conn.accepted_at > limit or (conn.probe_only and not self._may_be_healthz(conn))
            if late or not self._parking.park(conn, now + PARK_S):
                if conn.probe_only:
                    self.shed("cap")
                conn.close()
            return
        if head is _CLOSED:  # the client left before a request: nothing for a worker to do
            conn.close()
            return
        if head and self.healthz is not None and self._answer_healthz(conn, head):
            return
        if conn.probe_only:  # past the cap, and not a /healthz: closed unanswered
            self.shed("cap")
            conn.close()
            return
        super().process_conn(conn)

    def _peek_head(self, conn: Any) -> bytes | None:
        """What a new connection has sent, when its request head is all there (or it has sent
        a lot: the worker's parser then decides, b""); ``_CLOSED`` when the client has closed
        (or its socket failed) before its head was in; None when only part of the head has
        come."""
        try:
            data: bytes = conn.socket.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return _CLOSED
        if not data:
            return _CLOSED
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            return data[: end + 4]
        if len(data) >= _PEEK_BYTES:
            return b""
        return _CLOSED if _peer_hung_up(conn.socket) else None

    def _may_be_healthz(self, conn: Any) -> bool:
        """Whether what a connection has sent so far may still become ``GET /healthz``."""
        try:
            data: bytes = conn.socket.recv(len(HEALTHZ_REQUEST), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return HEALTHZ_REQUEST.startswith(data)

    def _answer_healthz(self, conn: Any, head: bytes) -> bool:
        """Answer a whole ``GET /healthz`` already received, without a worker (never blocks)."""
        lower = head.lower()
        if not head.startswith(HEALTHZ_REQUEST) or b"\ncontent-length:" in lower or b"\ntransfer-encoding:" in lower:
            return False  # another request, or one with a body: the workers' full parser decides
        assert self.healthz is not None
        date = email.utils.formatdate(usegmt=True).encode()
        sock = conn.socket
        try:
            sock.recv(len(head), socket.MSG_DONTWAIT)
            sock.send(self.healthz.replace(b"\r\n\r\n", b"\r\nDate: " + date + b"\r\n\r\n", 1), socket.MSG_DONTWAIT)
        except OSError:
            pass
        conn.close()
        return True

    def error_log(self, msg: str = "", level: int = 20, traceback: bool = False) -> None:
        # cheroot's own errors (a client's socket error, a bad TLS handshake): one line, no
        # traceback, rate-limited; a flood of them cannot fill a disk
        import sys

        exc = sys.exc_info()[1]
        detail = f": {type(exc).__name__}: {exc}" if traceback and exc is not None else ""
        self.log.say(f"dynprof serve: HTTP server: {msg}{detail}"[:500])


class Reserve:
    """WSGI middleware: at most ``limit`` requests inside the app at once (the answer's
    writing included), ``/healthz`` excepted; one more is 503 with Retry-After at once. With
    ``limit`` below the server's threads, token holders' slow renders and downloads (a client
    that reads its answer a byte at a time holds its thread) always leave a thread to the
    others: the API, and ``/healthz`` where the workers answer it (TLS)."""

    BODY = b'{"error": "every thread of this sidecar is busy; retry later", "code": 429}'

    def __init__(self, app: Any, limit: int, log: RefusalLog | None = None, retry_after_s: int = 2) -> None:
        self.app = app
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._log = log or RefusalLog()
        self._retry_after = str(retry_after_s)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            return self.app(environ, start_response)
        if not self._slots.acquire(blocking=False):
            self._log.refused(
                429, "every thread busy", environ.get("REQUEST_METHOD", "?"), environ.get("PATH_INFO", "?"),
                environ.get("REMOTE_ADDR"),
            )  # fmt: skip
            start_response(
                "429 Too Many Requests",
                [("Content-Type", "application/json"), ("Content-Length", str(len(self.BODY))),
                 ("Retry-After", self._retry_after), ("Cache-Control", "no-store"),
                 ("X-Content-Type-Options", "nosniff")],
            )  # fmt: skip
            return [self.BODY]
        try:
            answer = self.app(environ, start_response)
        except BaseException:
            self._slots.release()
            raise
        return ClosingIterator(answer, [self._slots.release])


def healthz_answer(app: Any) -> bytes | None:
    """The app's whole HTTP answer to ``GET /healthz`` (it does not depend on the request),
    with ``Connection: close``; None when the app does not answer it 200."""
    from werkzeug.test import EnvironBuilder, run_wsgi_app

    environ = EnvironBuilder(path="/healthz", method="GET").get_environ()
    app_iter, status, headers = run_wsgi_app(app, environ, buffered=True)
    body = b"".join(app_iter)
    if not status.startswith("200"):
        return None
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("content-length", "connection", "date")]
    lines += [f"Content-Length: {len(body)}", "Server: dynprof", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
