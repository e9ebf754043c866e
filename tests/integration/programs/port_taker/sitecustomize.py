"""Loaded (through PYTHONPATH) into a program under test: every TCP port the program has the
system pick (a bind to port 0) is taken by a listener here as soon as the program's socket
closes. A program that picks a port, lets it go and binds it later then meets EADDRINUSE at
once, as it may by chance on a loaded machine."""

from __future__ import annotations

import socket

_picked: set[int] = set()  # ids of sockets bound to port 0
_held: list[socket.socket] = []
_bind = socket.socket.bind
_close = socket.socket.close


def _bind_and_mark(self: socket.socket, address: object) -> None:
    _bind(self, address)  # type: ignore[arg-type]
    if self.family == socket.AF_INET and isinstance(address, tuple) and address[1] == 0:
        _picked.add(id(self))


def _close_and_take(self: socket.socket) -> None:
    port = None
    if id(self) in _picked:
        _picked.discard(id(self))
        try:
            port = self.getsockname()[1]
        except OSError:
            port = None
    _close(self)
    if port:
        taker = socket.socket()
        taker.bind(("127.0.0.1", port))
        taker.listen()
        _held.append(taker)


socket.socket.bind = _bind_and_mark  # type: ignore[method-assign]
socket.socket.close = _close_and_take  # type: ignore[method-assign]
