"""Length-prefixed frames: a 4-byte big-endian length, then that many payload bytes."""

from __future__ import annotations

import socket
import struct
import time

PROTOCOL_VERSION = 1
# Requests are tiny; replies carry at most a status or a stacks dump. 16 MiB bounds both.
MAX_FRAME_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a valid frame, or closed mid-frame."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks = []
    remaining = n
    while remaining:
        if deadline is not None:
            # The socket timeout bounds one recv(); the deadline bounds the whole frame, so a
            # peer that drips a byte now and then cannot hold the reader for ever.
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not complete by its deadline ({n - remaining} of {n} bytes read)")
            sock.settimeout(left)
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise FrameError(f"connection closed with {remaining} of {n} bytes unread")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, deadline: float | None = None) -> bytes:
    """Read one frame. ``deadline`` (a ``time.monotonic()`` value) bounds the whole frame:
    past it, :class:`TimeoutError` is raised whatever the socket's own timeout."""
    header = _recv_exact(sock, _HEADER.size, deadline)
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return _recv_exact(sock, length, deadline)
