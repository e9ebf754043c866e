"""Free ports for the tests' servers and stores, chosen where nothing takes them meanwhile.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range (32768-60999 by
default), the range every outgoing connection's local port also comes from: between a test
choosing one and its server binding it (a TCPStore in a rank that first imports torch, seconds
later on a loaded machine), a connection of another test can take it, and the store fails with
EADDRINUSE. These ports come from below that range, each xdist worker from its own slice (up to
16 workers; the GPU machine runs the fault suite 12-14 at a time), picked by the system's random
source (a plugin that seeds ``random`` for each test would give two workers the same pick), and
each is checked free by binding it on every address.
"""

from __future__ import annotations

import os
import random
import re
import socket

BASE = 20000
SLICE = 750  # ports per xdist worker: 16 workers stay below 32000
WORKERS = 16
_PICK = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker() -> int:
    m = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(m.group(1)) if m else 0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # fails for a port bound on any address, or still in TIME_WAIT
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, outside the ephemeral range where that range leaves room."""
    start = BASE + (_worker() % WORKERS) * SLICE
    if start + SLICE <= _ephemeral_low():
        for _ in range(100):
            port = _PICK.randrange(start, start + SLICE)
            if _bindable(port):
                return port
    with socket.socket() as s:  # no room below the range (a machine configured so): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
