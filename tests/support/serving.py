"""A `dynprof serve` that a test started, asked over a raw socket."""

from __future__ import annotations

import socket


def healthz(port: int) -> bool:
    """Whether the server on this host's ``port`` answers /healthz with 200 within 2 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
