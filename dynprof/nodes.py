"""A node (a sidecar's address) and one node's answer: the value types that the job-wide layer,
the watch, the sidecar and the healthcheck's link rounds all pass around.

Every name of a node (an option, a host file, an action's ``hosts``, a line of the job's store) is
parsed by :func:`parse_node`; an answer is built by :class:`dynprof.job.client.SidecarClient`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Any

from dynprof import errors
from dynprof.untrusted import open_regular

DEFAULT_PORT = 8787
MAX_HOSTFILE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, order=True)
class Node:
    host: str
    port: int = DEFAULT_PORT

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return self.address


_PORT = re.compile(r"[0-9]{1,5}")
_NOT_IN_A_NAME = frozenset("/?#@[]\\%")


def parse_node(text: str) -> Node:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT``.

    Whatever names the node (an option, a host file, an action's ``hosts``, a line of the job's
    store) is checked here: a port of ASCII digits 1-65535, a host of printable characters
    without blanks or URL syntax, an IPv6 address in brackets that is one. Anything else is a
    :class:`~dynprof.errors.UsageError`, never a failure further down."""
    if not isinstance(text, str):
        raise errors.UsageError("a node name must be text")
    text = text.strip()
    if not text:
        raise errors.UsageError("an empty node name")
    shown = ascii(text[:80])
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise errors.UsageError(f"bad node address {shown}: no closing ]")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise errors.UsageError(f"bad node address {shown}")
            port_text = rest[1:]
        if not _is_ipv6(host):
            raise errors.UsageError(f"bad node address {shown}: not an IPv6 address in []")
    elif text.count(":") == 1:
        host, port_text = text.split(":", 1)
    elif ":" in text and not _is_ipv6(text):
        raise errors.UsageError(f"bad node address {shown}: write an IPv6 address as [ADDRESS]:PORT")
    port = DEFAULT_PORT
    if text.endswith(":") or port_text:
        if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
            raise errors.UsageError(f"bad port in {shown}: 1-65535")
        port = int(port_text)
    if ":" in host:
        return Node(host, port)  # an IPv6 address, checked above
    if not host or len(host) > 253 or any(c.isspace() or not c.isprintable() or c in _NOT_IN_A_NAME for c in host):
        raise errors.UsageError(f"bad node name {host[:80]!a}")
    return Node(host, port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP literal, as written) is this machine's loopback:
    ``localhost`` or an address of 127.0.0.0/8 or ::1 (no DNS is asked)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return text.isascii() and text.isprintable()


def sidecar_port() -> int:
    """The port of the sidecars named by Slurm (host names only): ``DYNPROF_SIDECAR_PORT``, else 8787."""
    text = os.environ.get("DYNPROF_SIDECAR_PORT", "")
    if not text:
        return DEFAULT_PORT
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise errors.UsageError(f"DYNPROF_SIDECAR_PORT={text[:40]!a}: a port 1-65535")
    return int(text)


def parse_hosts(text: str) -> list[Node]:
    return [parse_node(part) for part in text.split(",") if part.strip()]


def read_hostfile(path: str) -> list[Node]:
    """One node per line (``HOST[:PORT]``; MPI-style ``HOST slots=8`` is read as ``HOST``);
    blank lines and ``#`` comments are skipped."""
    with open_regular(
        path, f"cannot read the host file {path}", f"the host file {path} is not a regular file", errors.UsageError
    ) as fh:
        data = fh.read(MAX_HOSTFILE_BYTES + 1)
    if len(data) > MAX_HOSTFILE_BYTES:
        raise errors.UsageError(f"the host file {path} is over {MAX_HOSTFILE_BYTES} bytes")
    nodes = []
    for line in data.decode("utf-8", "replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            nodes.append(parse_node(line.split()[0]))
    return nodes


@dataclass(frozen=True)
class CommandError:
    """The error a node's command stopped on, as its sidecar's answer carries it (``error``)."""

    type: str
    message: str
    help: str
    exit_code: int


@dataclass
class NodeAnswer:
    """One node's answer to an action, or why there is none (``error`` set, ``answered`` False)."""

    node: Node
    answered: bool
    host: str | None = None
    exit_code: int | None = None
    result: Any = None
    messages: list[str] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0
    dynprof_version: str | None = None
    failure: CommandError | None = None  # the command ran and stopped on this error
    status: int | None = None  # without an answer: the HTTP status the node refused with, if any
    cut: bool = False  # without an answer: it was dropped, the command's total for all nodes being reached

    @property
    def ok(self) -> bool:
        return self.answered and self.exit_code == 0

    def command_error(self) -> str | None:
        """The command's own error, when it ran and failed: the answer's structured ``error``,
        else (a command that ended with an exit code of its own) its last stderr line."""
        if not self.answered or self.exit_code == 0:
            return None
        if self.failure is not None:
            return self.failure.message
        return self.messages[-1] if self.messages else None

    def summary(self, label: str) -> dict[str, Any]:
        return {
            "node": label,
            "host": self.host,
            "ok": self.ok,
            "answered": self.answered,
            "error": self.error or self.command_error(),
            "cut": self.cut,
            "exit_code": self.exit_code,
            "elapsed_s": round(self.elapsed_s, 3),
            "messages": self.messages,  # what the command wrote on stderr there
        }
