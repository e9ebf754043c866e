"""A `dynprof serve` that a test starts (its token file, its process, its first answer), asked
over a raw socket or over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def healthz(port: int) -> bool:
    """Whether the server on this host's ``port`` answers /healthz with 200 within 2 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def write_token(path: Path, text: str) -> Path:
    """``text`` written to ``path``, readable by its owner only (as `dynprof serve` asks)."""
    path.write_text(text)
    path.chmod(0o600)
    return path


def serve(port: int, token: Path, *args: str, **popen: Any) -> subprocess.Popen:
    """`dynprof serve --port PORT --token-file TOKEN ARGS...` started with ``popen``'s keywords."""
    command = [sys.executable, "-m", "dynprof", "serve", "--port", str(port), "--token-file", str(token), *args]
    return subprocess.Popen(command, **popen)


def wait_answering(url: str, server: subprocess.Popen, seconds: float) -> None:
    """Return once ``url`` answers; an AssertionError if ``server`` exits or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise AssertionError("dynprof serve did not answer") from None
            time.sleep(0.2)
