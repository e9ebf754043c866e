"""The shape every job-level command shares (``ps``, ``ls``, ``stacks``, ``start``, ``stop``,
``memory``, ``nccl``): on this node's agents, or, given nodes (``--hosts``, ``--hostfile``,
``--slurm``, ``--discover``), on every node's through their sidecars.

A subclass adds its own options (:meth:`JobCommand.add_arguments`) and answers both ways:
:meth:`collect_local` (what the sidecar's action of the same name runs) and
:meth:`collect_nodes` (the job-wide answer, merged from the nodes' ``collect_local`` results).
The dispatch between them, and the node options, are here once.
"""

from __future__ import annotations

import argparse
from typing import ClassVar

from dynprof.cli._common import add_json
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.job.discovery import Node
from dynprof.result import Result


class JobCommand:
    name: ClassVar[str]  # the subcommand, and the sidecar action of the same name
    takes_fetch: ClassVar[bool] = False  # job-wide, it can copy the artifacts back (--fetch)

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        self.add_arguments(parser)
        add_json(parser)
        add_many_node_args(parser, fetch=self.takes_fetch)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        raise NotImplementedError

    def collect(self, args: argparse.Namespace) -> Result:
        nodes = nodes_requested(args)
        if nodes is None:
            return self.collect_local(args)
        return self.collect_nodes(args, nodes)

    def collect_local(self, args: argparse.Namespace) -> Result:
        raise NotImplementedError

    def collect_nodes(self, args: argparse.Namespace, nodes: list[Node]) -> Result:
        raise NotImplementedError

    def render(self, result: Result) -> str:
        raise NotImplementedError
