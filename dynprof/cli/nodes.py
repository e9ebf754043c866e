"""Print the nodes of a job that job-level commands would reach (one sidecar address a line).

    dynprof nodes --slurm                      # this Slurm allocation's nodes
    dynprof nodes --slurm 123456               # Slurm job 123456's nodes (asks scontrol)
    dynprof nodes --job J --discover           # what the ranks of J registered in the job's store
    dynprof nodes --job J --discover > nodes.txt && dynprof stacks --job J --hostfile nodes.txt

The output is a host file (``HOST:PORT`` per line). With --discover, the ranks that registered
and those missing are listed on stderr (with --json, in the JSON). The sources add up and the
result is deduplicated in order, as in every job-level command.
"""

from __future__ import annotations

import argparse
from typing import Any

from collectors.stacks import rank_runs
from dynprof import errors
from dynprof.cli._common import add_json, printable
from dynprof.job import discovery
from dynprof.result import Result


class NodesCommand:
    """Print the nodes of a job that job-level commands would reach (one sidecar address a line)."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", metavar="JOB", help="the job (with --discover; with --slurm, a Slurm job id)")
        discovery.add_node_args(parser)
        add_json(parser)

    def collect(self, args: argparse.Namespace) -> Result:
        if not (args.hosts is not None or args.hostfile or args.slurm is not None or args.discover):
            raise errors.UsageError(
                "name a source of nodes: --hosts, --hostfile, --slurm [JOB] or --job J --discover",
                help="See `dynprof nodes --help`.",
            )
        nodes = discovery.resolve_nodes(args) or []
        found: discovery.Discovery | None = getattr(args, "discovery", None)
        doc: dict[str, Any] = {"nodes": [n.address for n in nodes]}
        messages: list[str] = []
        if found is not None:
            doc.update(
                job=found.job,
                store=found.store,
                asked_pid=found.asked_pid,
                world_size=found.world_size,
                ranks=found.ranks,
                missing_ranks=found.missing_ranks,
            )
            if not args.json:  # with --json, the JSON says it
                missing = found.missing_ranks
                messages.append(
                    printable(
                        f"job {found.job}: {len(found.ranks)} of {found.world_size} rank(s) registered "
                        f"in {found.store} on {len(found.nodes)} node(s)"
                    )
                    + (f"; not registered: ranks {rank_runs(missing)}" if missing else "")
                )
        return Result(doc, 0, messages)

    def render(self, result: Result) -> str:
        """A host file: one ``HOST:PORT`` a line."""
        return "\n".join(printable(address) for address in result.doc["nodes"])
