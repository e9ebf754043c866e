"""Which nodes a job-level command reaches: the sidecars named by --hosts / --hostfile.

A node is a sidecar address, ``HOST[:PORT]`` (port 8787 unless given; IPv6 as ``[::1]:8787``).
:func:`resolve_nodes` returns ``None`` when the command should act on this node only (no
option asked for other nodes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynprof import errors

DEFAULT_PORT = 8787
MAX_NODES = 65536
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


def parse_node(text: str) -> Node:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT``."""
    text = text.strip()
    if not text:
        raise errors.UsageError("an empty node name")
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise errors.UsageError(f"bad node address {text!r}: no closing ]")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise errors.UsageError(f"bad node address {text!r}")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":", 1)
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise errors.UsageError(f"bad port in {text!r}: 1-65535")
        port = int(port_text)
    if not host or any(c.isspace() or c in "/?#@" for c in host) or len(host) > 253:
        raise errors.UsageError(f"bad node name {host!r}")
    return Node(host, port)


def parse_hosts(text: str) -> list[Node]:
    return [parse_node(part) for part in text.split(",") if part.strip()]


def read_hostfile(path: str) -> list[Node]:
    """One node per line (``HOST[:PORT]``; MPI-style ``HOST slots=8`` is read as ``HOST``);
    blank lines and ``#`` comments are skipped."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_HOSTFILE_BYTES + 1)
    except OSError as exc:
        raise errors.UsageError(f"cannot read the host file {path}: {exc.strerror}") from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise errors.UsageError(f"the host file {path} is over {MAX_HOSTFILE_BYTES} bytes")
    nodes = []
    for line in data.decode("utf-8", "replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            nodes.append(parse_node(line.split()[0]))
    return nodes


def add_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hosts",
        metavar="HOST[:PORT],...",
        help="act through the sidecars (`dynprof serve`) of these nodes, not this node's agents",
    )
    parser.add_argument("--hostfile", metavar="FILE", help="as --hosts, one node per line")


def resolve_nodes(args: argparse.Namespace) -> list[Node] | None:
    """The nodes asked for, deduplicated in order; None when none was."""
    nodes: list[Node] = []
    if getattr(args, "hosts", None):
        nodes += parse_hosts(args.hosts)
    if getattr(args, "hostfile", None):
        nodes += read_hostfile(args.hostfile)
    if not nodes:
        if getattr(args, "hosts", None) is not None or getattr(args, "hostfile", None):
            raise errors.UsageError("no nodes given")
        return None
    unique = list(dict.fromkeys(nodes))
    if len(unique) > MAX_NODES:
        raise errors.UsageError(f"{len(unique)} nodes: at most {MAX_NODES}")
    return unique
