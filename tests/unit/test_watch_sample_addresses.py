"""The watch's straggler sample goes to the nodes the user named, and nowhere else: never to
HOST:8787 (the default port) for a node named HOST:PORT, which would hand the sidecars' token
to whatever listens there."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dynprof.cli import main
from dynprof.nodes import DEFAULT_PORT

TOKEN = "s3cret-token-for-the-sidecars"


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], job: str | None) -> None:
        super().__init__(address, Handler)
        self.job = job  # answer progress for this job (a sidecar); None: a bystander
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization)


class Handler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append((method, self.path, self.headers.get("Authorization") or ""))
        if self.server.job is not None and method == "GET" and self.path.startswith("/api/v1/progress"):
            now = time.time()
            row = {
                "job": self.server.job,
                "rank": 0,
                "world_size": 1,
                "pid": 4242,
                "host": "node",
                "step": 7,
                "last_step_at": now,
                "last_step_age_s": 0.0,
                "step_time_s": 0.1,
                "agent": "up",
                "process_state": "running",
                "polled_at": now,
            }
            body = json.dumps(
                {"schema": "dynprof.progress", "schema_version": 1, "host": "node", "time": now, "ranks": [row]}
            ).encode()
            status = 200
        else:
            body = json.dumps({"error": {"code": "NOT_FOUND", "message": "not here"}}).encode()
            status = 404
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")


def _serve(server: Recorder) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def default_port_listener() -> Iterator[Recorder]:
    """A listener of ours on 127.0.0.1:8787, where nobody told the watch to go."""
    try:
        server = Recorder(("127.0.0.1", DEFAULT_PORT), None)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            pytest.skip(f"127.0.0.1:{DEFAULT_PORT} is taken by another process: cannot listen there for the test")
        raise
    thread = _serve(server)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


@pytest.fixture
def sidecars() -> Iterator[list[Recorder]]:
    """Two fake sidecars on free ports of 127.0.0.1 (they answer progress, refuse the rest)."""
    servers = [Recorder(("127.0.0.1", 0), "j"), Recorder(("127.0.0.1", 0), "j")]
    threads = [_serve(s) for s in servers]
    try:
        yield servers
    finally:
        for s, t in zip(servers, threads):
            s.shutdown()
            s.server_close()
            t.join(timeout=30)


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return str(path)


def _localhost_reaches_ipv4() -> bool:
    try:
        return any(info[0] == socket.AF_INET for info in socket.getaddrinfo("localhost", None))
    except OSError:
        return False


@pytest.mark.parametrize("layout", ["one sidecar", "127.0.0.1 and localhost"])
def test_a_sample_goes_only_to_the_named_addresses(layout, default_port_listener, sidecars, tmp_path, capsys):
    # GIVEN a listener on the default port, and sidecars on other ports: one of them, or two
    # named by two host names (127.0.0.1:P1, localhost:P2: each host appears once)
    if layout == "one sidecar":
        named = [f"127.0.0.1:{sidecars[0].server_address[1]}"]
        used = sidecars[:1]
    else:
        if not _localhost_reaches_ipv4():
            pytest.skip("localhost does not resolve to an IPv4 address here")
        named = [f"127.0.0.1:{sidecars[0].server_address[1]}", f"localhost:{sidecars[1].server_address[1]}"]
        used = sidecars

    # WHEN the watch checks once with a straggler sample due at once
    code = main(
        [
            "watch",
            "--job",
            "j",
            "--hosts",
            ",".join(named),
            "--token-file",
            _token_file(tmp_path),
            "--sample-every",
            "0.001",
            "--once",
            "--json",
            "--no-save",
            "--no-healthcheck",
            "--node-timeout",
            "30",
        ]
    )

    # THEN nothing reached the default port, and the sample's requests went to the sidecars named
    out, err = capsys.readouterr()
    assert code == 0, err
    assert default_port_listener.requests == [], default_port_listener.requests
    for server in used:
        actions = [path for method, path, _ in server.requests if method == "POST"]
        assert "/api/v1/actions/ps" in actions, server.requests
        assert all(auth == f"Bearer {TOKEN}" for _, _, auth in server.requests)
    # and the sample said what it found: one event on stdout, one line on stderr
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    samples = [e for e in events if e.get("event") == "straggler_sample"]
    assert len(samples) == 1, events
    assert samples[0]["schema"] == "dynprof.watch.event" and samples[0]["sample"]["verdict"] is None
    assert samples[0]["sample"]["note"], samples[0]
    assert [line for line in err.splitlines() if "straggler sample" in line], err
