"""The options that send a job-level command to many nodes, and whether a command was asked to.

Kept apart from :mod:`dynprof.job.client` (the HTTP client) and the merges so that a command
run on this node only imports none of that.
"""

from __future__ import annotations

import argparse

from dynprof import errors
from dynprof.cli._common import bounded_int, path_arg, seconds
from dynprof.job.discovery import add_node_args, resolve_nodes
from dynprof.job.merge import DEFAULT_MAX_IN_FLIGHT, DEFAULT_NODE_TIMEOUT_S
from dynprof.nodes import Node


def add_many_node_args(parser: argparse.ArgumentParser, fetch: bool = False) -> None:
    group = parser.add_argument_group("many nodes (through each node's `dynprof serve`; see docs/many-nodes.md)")
    add_node_args(group)  # type: ignore[arg-type]
    group.add_argument(
        "--token-file",
        type=path_arg,
        metavar="FILE",
        help="the sidecars' access token (a file of mode 0600; default $DYNPROF_TOKEN_FILE)",
    )
    group.add_argument(
        "--cacert",
        type=path_arg,
        metavar="FILE",
        help="talk to the sidecars over https, trusting the CA certificates in FILE (PEM)",
    )
    group.add_argument(
        "--node-timeout",
        type=seconds,
        default=DEFAULT_NODE_TIMEOUT_S,
        metavar="SEC",
        help=f"seconds each node has to answer, beyond the command's own wait (default {DEFAULT_NODE_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--max-in-flight",
        type=bounded_int(1, 4096),
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help=f"ask at most N nodes at once (default {DEFAULT_MAX_IN_FLIGHT})",
    )
    if fetch:
        group.add_argument(
            "--fetch",
            type=path_arg,
            metavar="DIR",
            help="copy the artifacts back into DIR (as the store lays them out: job/host/rank/kind/...), "
            "checking sizes and sha256; default: list them where they are",
        )


def nodes_requested(args: argparse.Namespace) -> list[Node] | None:
    """The nodes to fan out to, or None to act on this node's agents.

    Only options name nodes (nothing is found implicitly), so a sidecar's action, whose options
    never carry them, runs on its own node (its ``collect_local``); selectors that only make
    sense on one node (--pid, --attach, --core) keep the command local unless nodes were named
    explicitly, which is a usage error."""
    named = bool(
        getattr(args, "hosts", None)
        or getattr(args, "hostfile", None)
        or getattr(args, "slurm", None) is not None
        or getattr(args, "discover", False)
    )
    local_only = [
        flag
        for flag, value in (
            ("--pid", getattr(args, "pid", None)),
            ("--attach", getattr(args, "attach", False)),
            ("--core", getattr(args, "core", None)),
        )
        if value
    ]
    if local_only:
        if named:
            raise errors.UsageError(
                f"{local_only[0]} works on this node only: with --hosts, select the ranks by --job (or --all)",
                help="To attach agents, run `dynprof attach --job JOB` on each node first.",
            )
        return None
    nodes = resolve_nodes(args)
    if nodes is None:
        if getattr(args, "fetch", None):
            raise errors.UsageError("--fetch copies artifacts from other nodes: give --hosts or --hostfile")
        return None
    return nodes
