"""dynprof.sidecar.server: cheroot's WSGI server held against hostile clients. The open-file
arithmetic and the limit's raising, the parking of slow heads, the deadline reader, the shedding
episodes' log lines, the TLS adapter, the middleware that keeps a thread free, and the early
``/healthz`` answer are checked on their own; what a client sees (the deadlines, a bad
Content-Length, the early /healthz, a body left unread, the cap) is checked against a real
server on 127.0.0.1 on an ephemeral port, since the socket is what is tested there."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import resource
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cheroot.errors import FatalSSLAlert

from dynprof.sidecar import server as srv
from dynprof.sidecar.guard import RefusalLog
from dynprof.sidecar.server import (
    MIN_CONNECTIONS,
    LazyHandshakeSSLAdapter,
    Reserve,
    SidecarServer,
    connection_cap,
    descriptor_reserve,
    healthz_answer,
    min_open_files,
    raise_open_file_limit,
)

DEADLINE_S = 30.0  # what a test waits for at most (each wait polls, or a socket times out)
# the whole early answer to GET /healthz, told apart from the app's own ("ok")
EARLY = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\nearly"


def wait_for(what: Callable[[], bool], seconds: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class App:
    """A WSGI app that records the paths it is asked for and answers ``ok`` (reading the body
    when ``read_body``; a read past the body deadline is answered 408, as the sidecar's app does;
    ``/408`` is answered 408 whatever came)."""

    def __init__(self, read_body: bool = True) -> None:
        self.paths: list[str] = []
        self.bodies: list[bytes] = []
        self.read_body = read_body

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        self.paths.append(environ["PATH_INFO"])
        status, body = "200 OK", b"ok"
        if environ["PATH_INFO"] == "/408":
            status = "408 Request Timeout"
        if self.read_body and environ.get("CONTENT_LENGTH"):
            try:
                self.bodies.append(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))
            except TimeoutError:
                status, body = "408 Request Timeout", b"late"
        start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]


@contextlib.contextmanager
def serving(app: Any, **kwargs: Any) -> Iterator[SidecarServer]:
    """A serving SidecarServer on 127.0.0.1 (an ephemeral port), stopped at the end."""
    options: dict[str, Any] = {"numthreads": 2, "timeout": 60, "head_timeout": 10.0, "body_timeout": 10.0}
    options.update(kwargs)
    ssl_adapter = options.pop("ssl_adapter", None)
    server = SidecarServer(("127.0.0.1", 0), app, **options)
    server.ssl_adapter = ssl_adapter  # set before it binds, as `dynprof serve` does
    server.prepare()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(DEADLINE_S)


def connect(server: SidecarServer) -> socket.socket:
    return socket.create_connection(server.bind_addr, timeout=DEADLINE_S)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def exchange(server: SidecarServer, data: bytes) -> bytes:
    with connect(server) as s:
        s.sendall(data)
        return read_all(s)


# -- the open-file arithmetic ------------------------------------------------------------------
class FakeResource:
    """The ``resource`` module as the server sees it: one soft and hard RLIMIT_NOFILE."""

    RLIMIT_NOFILE = resource.RLIMIT_NOFILE
    RLIM_INFINITY = resource.RLIM_INFINITY

    def __init__(self, soft: int, hard: int, refuse: type[Exception] | None = None) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse
        self.set: list[tuple[int, int]] = []

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == self.RLIMIT_NOFILE
        if self.refuse is not None:
            raise self.refuse("not permitted")
        self.set.append(limits)
        self.limits = limits


def test_the_descriptors_kept_free_grow_with_the_threads():
    assert descriptor_reserve(0) == 64 and descriptor_reserve(8) == 128
    assert min_open_files(1) == 64 + 8 + MIN_CONNECTIONS


def test_the_cap_follows_this_process_s_soft_limit(monkeypatch):
    monkeypatch.setattr(srv, "resource", FakeResource(2048, 4096))
    assert connection_cap(4) == 2048 - descriptor_reserve(4)
    monkeypatch.setattr(srv, "resource", FakeResource(FakeResource.RLIM_INFINITY, FakeResource.RLIM_INFINITY))
    assert connection_cap(4) == (1 << 20) - descriptor_reserve(4)
    assert connection_cap(4, FakeResource.RLIM_INFINITY) == (1 << 20) - descriptor_reserve(4)


@pytest.mark.parametrize(
    ("soft", "hard", "wanted", "set_to", "after"),
    [
        (1024, 4096, 2048, (2048, 4096), 2048),  # raised to what is wanted
        (1024, 4096, 10_000, (4096, 4096), 4096),  # no further than the hard limit
        (1024, resource.RLIM_INFINITY, 10_000, (10_000, resource.RLIM_INFINITY), 10_000),
        (8192, 65536, 2048, None, 8192),  # never lowered
        (2048, 4096, 2048, None, 2048),
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, 2048, None, resource.RLIM_INFINITY),
    ],
)
def test_the_open_file_limit_is_raised_never_lowered(monkeypatch, soft, hard, wanted, set_to, after):
    fake = FakeResource(soft, hard)
    monkeypatch.setattr(srv, "resource", fake)
    assert raise_open_file_limit(wanted) == (soft, after)
    assert fake.set == ([set_to] if set_to else [])


@pytest.mark.parametrize("refusal", [OSError, ValueError])
def test_a_limit_that_cannot_be_raised_is_left_as_it_was(monkeypatch, refusal):
    monkeypatch.setattr(srv, "resource", FakeResource(1024, 4096, refuse=refusal))
    assert raise_open_file_limit(2048) == (1024, 1024)


def test_the_limit_of_this_process_at_its_own_value_is_left_alone():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_file_limit(0) == (soft, soft)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


# -- the parts on their own -------------------------------------------------------------------
def test_a_peer_that_closed_its_side_is_seen_hung_up():
    a, b = socket.socketpair()
    try:
        assert srv._peer_hung_up(a) is False
        b.sendall(b"GET / HTT")  # a part of a head: still there
        assert srv._peer_hung_up(a) is False
        b.close()
        assert srv._peer_hung_up(a) is True
    finally:
        a.close()
    # a socket that failed (here closed: no descriptor) counts as gone
    assert srv._peer_hung_up(a) is True


def test_parked_connections_are_woken_in_their_time_order():
    woken: list[tuple[str, float]] = []
    parking = srv._Parking(lambda conn: woken.append((conn, time.monotonic())))
    now = time.monotonic()
    # GIVEN one connection parked until 0.3 s from now, then one due now (both parked before the
    # parking's thread may look: it waits on the same lock)
    with parking._cv:
        assert parking.park("later", now + 0.3)
        assert parking.park("now", now)
    # WHEN the parking's thread wakes them THEN the one due first comes first, the later one not early
    assert wait_for(lambda: len(woken) == 2)
    assert [conn for conn, _ in woken] == ["now", "later"]
    assert woken[1][1] >= now + 0.3


def test_parking_is_bounded_and_a_connection_that_cannot_be_woken_is_closed(monkeypatch):
    class Conn:
        closed = False

        def close(self) -> None:
            self.closed = True

    def wake(conn: Any) -> None:
        raise OSError(errno.EBADF, "closed meanwhile")

    monkeypatch.setattr(srv, "MAX_PARKED", 1)
    parking = srv._Parking(wake)
    # GIVEN a full parking (one place), its connection due at once
    gone = Conn()
    assert parking.park(gone, time.monotonic())
    # WHEN waking it fails THEN it is closed, and its place is free again
    assert wait_for(lambda: gone.closed)
    assert parking.park(Conn(), time.monotonic() + 3600)
    # AND past the bound a connection is refused a place (the caller closes it)
    assert parking.park(Conn(), time.monotonic() + 3600) is False


def test_the_reader_gives_up_at_its_deadline_however_the_bytes_drip():
    a, b = socket.socketpair()
    try:
        a.settimeout(None)  # a blocking socket: only the deadline can end a read
        reader = srv._DeadlineReader(a)
        # GIVEN no deadline: a read is a plain read
        b.sendall(b"one\n")
        assert reader.readline() == b"one\n"
        # GIVEN a deadline already passed: a read fails at once with cheroot's 408 message
        reader.set_deadline(0)
        with pytest.raises(TimeoutError, match="timed out"):
            reader.read(1)
        # AND with the deadline lifted, a read reads
        reader.set_deadline(None)
        b.sendall(b"two\n")
        assert reader.readline() == b"two\n"
        # GIVEN a deadline 0.2 s away and no byte coming: the read ends (in a thread, waited for)
        reader.set_deadline(0.2)
        ended: list[BaseException] = []

        def read() -> None:
            try:
                reader.read(1)
            except BaseException as exc:
                ended.append(exc)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(DEADLINE_S)
        assert not thread.is_alive() and isinstance(ended[0], TimeoutError)
        # AND the socket's own timeout is given back after the read
        assert a.gettimeout() is None
    finally:
        a.close()
        b.close()


def test_the_reader_gives_the_socket_its_idle_timeout_back_after_a_read():
    a, b = socket.socketpair()
    try:
        a.settimeout(20.0)
        reader = srv._DeadlineReader(a)
        reader.set_deadline(DEADLINE_S + 100)
        b.sendall(b"x\n")
        assert reader.readline() == b"x\n"
        assert a.gettimeout() == 20.0
    finally:
        a.close()
        b.close()


def new_server(out: io.StringIO, **kwargs: Any) -> SidecarServer:
    """A server made but not bound (prepare() binds)."""
    options: dict[str, Any] = {"numthreads": 1, "head_timeout": 3.0, "body_timeout": 3.0, "log": RefusalLog(out)}
    options.update(kwargs)
    return SidecarServer(("127.0.0.1", 0), App(), **options)


def test_a_shedding_episode_is_one_line_when_it_begins_and_one_when_it_ends(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(srv, "EPISODE_QUIET_S", 3600.0)
    server = new_server(out, max_connections=5)
    server.held(+1)
    assert server.connections_held == 1
    # WHEN connections are shed past the cap, twice
    server.shed("cap")
    server.shed("cap")
    server.shed("accept", OSError(errno.EMFILE, "Too many open files"))
    # THEN the episode's first says so in one line (its cause, the cap, the head deadline)
    (began,) = out.getvalue().splitlines()
    assert began == (
        "dynprof serve: shedding connections: 1 connections held, at the cap of 5; new ones are closed "
        "(connections whose head is not in are closed after 3 s)"
    )
    # AND the episode does not end while it is not quiet
    server.episode_tick()
    assert len(out.getvalue().splitlines()) == 1
    # WHEN it has been quiet long enough THEN one line gives its counts, once
    monkeypatch.setattr(srv, "EPISODE_QUIET_S", 0.0)
    server.episode_tick()
    server.episode_tick()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("dynprof serve: no longer shedding connections (1 held): in ")
    assert lines[1].endswith(" s, 2 closed past the cap, 1 accepts failed for want of descriptors")
    # AND the next shed begins a new episode, said in its own words
    server.shed("accept", OSError(errno.ENFILE, "Too many open files in system"))
    assert (
        out.getvalue()
        .splitlines()[2]
        .startswith(
            "dynprof serve: shedding connections: out of file descriptors ([Errno 23] Too many open files in system); "
            "accepting pauses 0.5 s at a time"
        )
    )


def test_cheroot_s_own_errors_are_one_bounded_line_without_traceback():
    out = io.StringIO()
    server = new_server(out)
    server.error_log("a client's socket failed")
    try:
        raise ValueError("bad\nhandshake")
    except ValueError:
        server.error_log("error in HTTPServer.tick", traceback=True)
        server.error_log("no detail asked", traceback=False)
    server.error_log("x" * 5000)
    lines = out.getvalue().splitlines()
    assert lines[0] == "dynprof serve: HTTP server: a client's socket failed"
    assert lines[1].startswith("dynprof serve: HTTP server: error in HTTPServer.tick: ValueError: bad")
    assert "Traceback" not in out.getvalue() and len(lines) == 4
    assert lines[2] == "dynprof serve: HTTP server: no detail asked"
    assert len(lines[3]) == 500


# -- TLS: the handshake left to a worker ---------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    made = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"openssl could not make a certificate: {made.stderr[-300:]!r}")
    return str(cert), str(key)


def test_the_tls_adapter_wraps_without_a_handshake(certificate):
    adapter = LazyHandshakeSSLAdapter(*certificate)
    a, b = socket.socketpair()
    try:
        wrapped, environ = adapter.wrap(a)
        # the handshake is not done here (it would block cheroot's accepting thread)
        assert isinstance(wrapped, ssl.SSLSocket) and wrapped.server_side and environ == {}
        assert wrapped.version() is None
    finally:
        a.close()
        b.close()
    closed = socket.socket()
    closed.close()
    with pytest.raises(FatalSSLAlert):
        adapter.wrap(closed)


def test_a_tls_client_is_served_and_a_bad_handshake_is_one_line(certificate):
    app, out = App(), io.StringIO()
    adapter = LazyHandshakeSSLAdapter(*certificate)
    with serving(app, log=RefusalLog(out), healthz=EARLY, ssl_adapter=adapter) as server:
        context = ssl.create_default_context(cafile=certificate[0])
        # WHEN a TLS client asks for /healthz THEN a worker answers it (the head is not
        # readable before the handshake), through the app
        with connect(server) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"ok") and app.paths == ["/healthz"]
        # WHEN a client sends what is no TLS hello THEN the handshake fails in a worker, in one
        # line, and the app is never asked
        assert exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert wait_for(lambda: "TLS handshake with" in out.getvalue())
    assert app.paths == ["/healthz"]
    (line,) = [x for x in out.getvalue().splitlines() if "TLS handshake" in x]
    assert line.startswith("dynprof serve: TLS handshake with ") and " failed: " in line


# -- what a client sees ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[SidecarServer, App]]:
    """One serving server (with an early /healthz) for the tests that need no other settings."""
    app = App()
    with serving(app, healthz=EARLY) as server:
        yield server, app


@pytest.fixture
def served(shared: tuple[SidecarServer, App]) -> tuple[SidecarServer, App]:
    server, app = shared
    app.paths.clear()
    app.bodies.clear()
    return server, app


def test_a_whole_healthz_is_answered_before_the_workers(served):
    server, app = served
    # WHEN a probe asks for /healthz THEN the selector answers it, dated, without the app
    answer = exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b"early"
    assert b"\r\nDate: " in head and app.paths == []
    assert exchange(server, b"GET /healthz HTTP/1.0\r\n\r\n").endswith(b"early") and app.paths == []
    # WHEN a /healthz carries a body, or another path is asked THEN the workers' parser and the app answer
    with_body = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    assert exchange(server, with_body).endswith(b"ok")
    chunked = b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n"
    assert exchange(server, chunked).endswith(b"ok")
    assert exchange(server, b"GET /healthzz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"ok")
    assert app.paths == ["/healthz", "/healthz", "/healthzz"]


def test_without_an_early_answer_the_app_answers_healthz():
    app = App()
    with serving(app, healthz=None) as server:
        assert exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"ok")
    assert app.paths == ["/healthz"]


@pytest.mark.parametrize("length", [b"-1", b"+5", b"0x10", b"1e3", b"5 5"])
def test_a_content_length_that_is_not_digits_is_400_and_closed(served, length):
    server, app = served
    answer = exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\nhello")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request")
    assert app.paths == []


def test_a_body_of_digits_is_read(served):
    server, app = served
    answer = exchange(server, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
    assert answer.startswith(b"HTTP/1.1 200 OK") and app.bodies == [b"hello"]


def test_a_body_that_drips_past_its_deadline_is_408_and_the_connection_closed():
    app = App()
    # (the head deadline is an hour: only the body's own deadline can end the read)
    with serving(app, head_timeout=3600.0, body_timeout=1.0) as server, connect(server) as s:
        # GIVEN a request whose head came at once, and 2 of its 10 body bytes
        s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
        # WHEN no more come THEN the app's read fails at the body deadline (408), and the
        # server closes the connection (what is left of the body is never read as a request)
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and answer.endswith(b"late")
    assert app.bodies == []


def test_a_body_left_unread_closes_the_connection_after_the_answer():
    app = App(read_body=False)
    with serving(app) as server, connect(server) as s:
        # GIVEN a body the app never reads (as when it refuses before reading), then a second
        # request pipelined behind it
        s.sendall(b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        s.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_all(s)
    # THEN one answer and the connection closed: the unread body is never parsed as a request
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 200 OK")
    assert app.paths == ["/first"]


def test_a_kept_alive_connection_whose_body_was_read_serves_the_next_request(served):
    server, app = served
    with connect(server) as s:
        s.sendall(b"POST /first HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        s.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = read_all(s)
    assert answer.count(b"HTTP/1.1 200 OK") == 2 and app.paths == ["/first", "/second"]


def test_a_408_answer_closes_the_connection(served):
    server, app = served
    with connect(server) as s:
        s.sendall(b"POST /408 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        s.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_all(s)
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 408 ")
    assert app.paths == ["/408"] and app.bodies == [b"hello"]


def test_a_slow_head_holds_no_worker():
    app = App()
    # GIVEN one worker, and a client whose head is still coming (its deadline an hour away)
    with serving(app, numthreads=1, head_timeout=3600.0) as server, connect(server) as slow:
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        # WHEN another client asks THEN it is answered (within the socket's 30 s): the slow one
        # waits in the selector, not in the only worker
        assert exchange(server, b"GET /quick HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").endswith(b"ok")
    assert app.paths == ["/quick"]


def test_a_dripping_head_is_closed_at_its_deadline():
    app = App()
    with serving(app, head_timeout=2.0) as server, connect(server) as slow:
        # GIVEN a client that keeps dripping header lines, never ending its head
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        closed = False
        deadline = time.monotonic() + DEADLINE_S
        while not closed and time.monotonic() < deadline:
            try:
                slow.sendall(b"X-Drip: 1\r\n")
                slow.settimeout(0.2)
                closed = slow.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
        # THEN the server closed it without an answer, and never gave it to the app
        assert closed
    assert app.paths == []


def test_clients_that_leave_before_their_request_are_let_go_without_a_worker():
    entered, release = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        entered.set()
        release.wait(3 * DEADLINE_S)  # longer than the test waits: the worker stays busy while it does
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    # GIVEN the only worker busy with a request, and an hour's head deadline
    with serving(app, numthreads=1, head_timeout=3600.0, timeout=3600) as server:
        opened: list[int] = []  # each connection the server took (its count of those held, +1)
        held = server.held
        server.held = lambda delta: (delta > 0 and opened.append(delta)) or held(delta)  # type: ignore[method-assign]
        with connect(server) as busy:
            busy.sendall(b"GET /busy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                assert entered.wait(DEADLINE_S)
                # WHEN a client connects and leaves without a byte, and another leaves after a
                # part of its head
                with connect(server):
                    pass
                with connect(server) as partial:
                    partial.sendall(b"GET / HTTP/1.1\r\n")
                # THEN the server took both and let them go while its worker is still busy: no
                # worker was needed
                assert wait_for(lambda: len(opened) == 3 and server.connections_held == 1)
            finally:
                release.set()
            assert read_all(busy).endswith(b"ok")


def test_a_connection_past_the_cap_is_closed_at_once_and_said():
    app, out = App(), io.StringIO()
    with serving(app, max_connections=0, log=RefusalLog(out)) as server:
        # GIVEN a cap of no connection: WHEN one comes THEN it is closed without an answer
        assert exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == b""
        assert wait_for(lambda: "shedding connections" in out.getvalue())
    assert app.paths == []
    assert "at the cap of 0; new ones are closed" in out.getvalue()


def test_past_the_cap_a_healthz_is_still_answered_and_nothing_else_is():
    app, out = App(), io.StringIO()
    # GIVEN a server at its cap (of no connection), answering /healthz early
    with serving(app, max_connections=0, healthz=EARLY, log=RefusalLog(out)) as server:
        # WHEN more clients than the /healthz lane has places each send part of another request
        flood = [connect(server) for _ in range(srv.HEALTHZ_LANE + 4)]
        try:
            for s in flood:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            # THEN each is closed unanswered, and said
            for s in flood:
                assert read_all(s) == b""
            assert wait_for(lambda: "shedding connections" in out.getvalue())
            # AND a /healthz is answered, again and again
            for _ in range(3):
                assert exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").endswith(b"early")
        finally:
            for s in flood:
                s.close()
        # WHEN clients fill the lane's places and send nothing THEN they are let go (after the
        # lane's grace), and a /healthz is answered after them
        silent = [connect(server) for _ in range(srv.HEALTHZ_LANE)]
        try:
            for s in silent:
                assert read_all(s) == b""
        finally:
            for s in silent:
                s.close()
        assert exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").endswith(b"early")
    assert app.paths == []  # no worker served any of them


# -- the early /healthz answer, and the middleware ---------------------------------------------
def test_the_healthz_answer_is_the_app_s_own_closed_and_undated():
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        assert environ["PATH_INFO"] == "/healthz" and environ["REQUEST_METHOD"] == "GET"
        start_response(
            "200 OK",
            [("Content-Type", "text/plain"), ("Date", "yesterday"), ("Connection", "keep-alive"),
             ("Content-Length", "99"), ("X-Content-Type-Options", "nosniff")],
        )  # fmt: skip
        return [b"o", b"k"]

    answer = healthz_answer(app)
    assert answer is not None
    head, body = answer.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    assert body == b"ok" and lines[0] == "HTTP/1.1 200 OK"
    assert sorted(lines[1:]) == sorted(
        ["Content-Type: text/plain", "X-Content-Type-Options: nosniff", "Content-Length: 2", "Server: dynprof",
         "Connection: close"]
    )  # fmt: skip


def test_an_app_that_does_not_answer_healthz_200_gets_no_early_answer():
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("404 NOT FOUND", [("Content-Type", "text/plain")])
        return [b"no"]

    assert healthz_answer(app) is None


def test_the_sidecar_s_own_app_has_an_early_healthz(tmp_path):
    from dynprof.sidecar.app import create_app
    from dynprof.store import ArtifactStore

    answer = healthz_answer(create_app(ArtifactStore(tmp_path / "store"), token="t" * 20))
    assert answer is not None and answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nConnection: close\r\n" in answer and b"Date:" not in answer


def test_the_reserve_says_busy_in_json_logs_it_and_frees_a_slot_when_the_app_raises():
    out = io.StringIO()
    fail = {"now": True}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if fail["now"]:
            raise RuntimeError("the app failed")
        start_response("200 OK", [])
        return [b"fine"]

    reserve = Reserve(app, 1, log=RefusalLog(out), retry_after_s=7)
    environ = {"PATH_INFO": "/api/v1/info", "REQUEST_METHOD": "GET", "REMOTE_ADDR": "10.0.0.1"}
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = status, dict(headers)

    # GIVEN an app that raises: its slot is given back
    with pytest.raises(RuntimeError):
        reserve(environ, start_response)
    fail["now"] = False
    held = reserve(environ, start_response)
    assert got["status"] == "200 OK"
    # WHEN the one slot is held THEN the next is 429 in JSON, with its Retry-After, and logged
    body = b"".join(reserve(environ, start_response))
    assert got["status"] == "429 Too Many Requests"
    assert json.loads(body) == {"error": "every thread of this sidecar is busy; retry later", "code": 429}
    assert got["headers"]["Retry-After"] == "7" and got["headers"]["Content-Length"] == str(len(body))
    assert got["headers"]["Cache-Control"] == "no-store"
    assert out.getvalue().splitlines() == [
        "dynprof serve: refused 429 (every thread busy): GET /api/v1/info from 10.0.0.1"
    ]
    held.close()
    assert b"".join(reserve(environ, start_response)) == b"fine"


# -- the reserve under a slow reader, accepts out of descriptors, the cap, a silent client -------
def test_the_reserve_keeps_a_thread_free_of_long_requests():
    from dynprof.sidecar.server import Reserve

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([b"a", b"b"])

    def call(reserve, path):
        got = {}

        def start_response(status, headers):
            got["status"], got["headers"] = status, dict(headers)

        answer = reserve({"PATH_INFO": path, "REQUEST_METHOD": "GET"}, start_response)
        return got, answer

    reserve = Reserve(app, 1)
    # GIVEN one request whose answer is still being written (a slow reader)
    first, answer = call(reserve, "/")
    assert first["status"] == "200 OK"
    # WHEN another comes THEN it is 429 at once, with a Retry-After; /healthz is never refused
    busy, _ = call(reserve, "/api/v1/info")
    assert busy["status"].startswith("429") and busy["headers"]["Retry-After"] == "2"
    assert call(reserve, "/healthz")[0]["status"] == "200 OK"
    # AND once the first answer is written and closed, the next one is served
    assert b"".join(answer) == b"ab"
    answer.close()
    assert call(reserve, "/api/v1/info")[0]["status"] == "200 OK"


def test_an_accept_out_of_descriptors_pauses_accepting_and_is_logged_once(monkeypatch):
    import errno
    import io

    from dynprof.sidecar import server as srv
    from dynprof.sidecar.guard import RefusalLog

    # GIVEN a prepared sidecar server whose accept fails for want of descriptors (EMFILE)
    out = io.StringIO()
    server = srv.SidecarServer(
        ("127.0.0.1", 0), lambda environ, start: [], numthreads=1, head_timeout=10, body_timeout=10,
        log=RefusalLog(out),
    )  # fmt: skip
    server.prepare()
    try:
        listener = server.socket.fileno()

        class Exhausted:
            def fileno(self) -> int:
                return listener

            def accept(self) -> None:
                raise OSError(errno.EMFILE, "Too many open files")

        manager = server._connections
        registered = lambda: any(conn is server for _, conn in manager._selector.connections)  # noqa: E731
        assert registered()
        # WHEN the selector's accept fails
        assert manager._from_server_socket(Exhausted()) is None
        # THEN the listening socket leaves the selector (no spinning on it), and the failure
        # raises nothing out of the selector's loop
        assert not registered()
        # WHEN the back-off has passed and the loop's periodic expiry runs
        manager._paused_until = 0.0
        manager._expire(threshold=0.0)
        # THEN accepting resumes
        assert registered()
        # AND a second failure in the same episode adds no line; the episode's end adds one
        assert manager._from_server_socket(Exhausted()) is None
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and "out of file descriptors" in lines[0] and "Too many open files" in lines[0]
        monkeypatch.setattr(srv, "EPISODE_QUIET_S", 0.0)
        manager._paused_until = 0.0
        manager._expire(threshold=0.0)
        lines = out.getvalue().splitlines()
        assert len(lines) == 2 and "no longer shedding" in lines[1] and "2 accepts failed" in lines[1]
    finally:
        server.stop()


def test_the_connection_cap_leaves_the_threads_their_descriptors():
    from dynprof.sidecar.server import MIN_CONNECTIONS, connection_cap, descriptor_reserve, min_open_files

    # GIVEN the open-file limits of a default shell, of the deployments, and a tiny one
    # THEN connections are held below the limit, the threads' reserve kept free
    assert connection_cap(8, 1024) == 1024 - descriptor_reserve(8) < 1024
    assert connection_cap(8, 4096) + descriptor_reserve(8) == 4096
    assert connection_cap(256, 64) == MIN_CONNECTIONS
    assert min_open_files(8) == descriptor_reserve(8) + MIN_CONNECTIONS


def test_a_new_connection_that_sends_nothing_is_closed_at_the_head_deadline():
    import socket
    import threading
    import time

    from dynprof.sidecar.server import SidecarServer

    # GIVEN a serving sidecar server with a head deadline of 1 s and an idle timeout of 60 s
    server = SidecarServer(
        ("127.0.0.1", 0), lambda environ, start: [], numthreads=1, timeout=60, head_timeout=1.0, body_timeout=1.0
    )
    server.prepare()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        # WHEN a client connects and sends nothing
        with socket.create_connection(server.bind_addr, timeout=30) as s:
            # THEN the server closes it long before the idle timeout (recv sees the close; the
            # socket's 30 s timeout only stops a hang)
            assert s.recv(1) == b""
        # AND it no longer counts it among the connections it holds
        deadline = time.monotonic() + 10
        while server.connections_held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.connections_held == 0
    finally:
        server.stop()
        thread.join(10)
