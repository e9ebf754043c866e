"""The shape every job-level command shares (``ps``, ``ls``, ``stacks``, ``start``, ``stop``,
``memory``, ``nccl``): on this node's agents, or, given nodes (``--hosts``, ``--hostfile``,
``--slurm``, ``--discover``), on every node's through their sidecars.

A subclass adds its own options (:meth:`JobCommand.add_arguments`) and answers both ways:
:meth:`collect_local` (this node's: the kind's collect, or its job module's, which the
sidecar's action of the same name calls too) and :meth:`collect_job` (the job-wide answer to
the action's options: the job-wide function of the sidecar's row of the same action, which its
job-wide action calls too; the merge they share is :mod:`dynprof.job.merge`). The dispatch
between them, the node options and the text of a job-wide answer are here once.
"""

from __future__ import annotations

import argparse
import io
from typing import TYPE_CHECKING, Any, ClassVar

from dynprof.cli._common import add_json, printable
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.job.merge import DEFAULT_NODE_TIMEOUT_S, Reach, client_of
from dynprof.nodes import Node
from dynprof.result import Result

if TYPE_CHECKING:  # the HTTP client and the sidecar's table are imported only where nodes are asked
    from dynprof.job.client import SidecarClient
    from dynprof.sidecar.table import Action


def client_for(args: argparse.Namespace) -> SidecarClient:
    """The sidecars' client, with the token and TLS the options name."""
    return client_of(args.token_file, args.cacert, args.node_timeout, args.max_in_flight)


def reach_of(args: argparse.Namespace, client: SidecarClient) -> Reach:
    """The CLI's reach: its --fetch, progress unless --json, its --node-timeout."""
    return Reach(
        client,
        fetch=getattr(args, "fetch", None) or None,
        progress=not getattr(args, "json", False),
        node_timeout=getattr(args, "node_timeout", DEFAULT_NODE_TIMEOUT_S),
    )


def action_of(name: str) -> Action:
    """The sidecar's row of action ``name`` (its table is imported when a command asks nodes)."""
    from dynprof.sidecar.table import ACTIONS

    return ACTIONS[name]


def forward_options(name: str, args: argparse.Namespace, **override: Any) -> dict[str, Any]:
    """The command's own options, as action ``name`` takes them (unset ones left out)."""
    out: dict[str, Any] = {}
    for key in action_of(name).options:
        value = override[key] if key in override else getattr(args, key, None)
        if value is None or value is False or value == []:
            continue
        out[key] = value
    return out


# -- text ----------------------------------------------------------------------------------------
class Text:
    """Lines of a command's text, written as ``print`` would write them."""

    def __init__(self) -> None:
        self._buf = io.StringIO()

    def print(self, *values: Any, end: str = "\n") -> None:
        print(*values, end=end, file=self._buf)

    def artifacts(self, artifacts: list[dict[str, Any]], fetched: list[dict[str, Any]] | None) -> None:
        for art in artifacts:
            self.print(printable(f"artifact on {art['node']}: {art['path']}"))
        for f in fetched or []:
            if f["error"]:
                self.print(printable(f"NOT FETCHED {f['id']} from {f['node']}: {f['error']}"))
            else:
                self.print(printable(f"fetched {f['files']} file(s) of {f['id']} from {f['node']} into {f['path']}"))

    def footer(self, doc: dict[str, Any]) -> None:
        """The nodes that did not answer, with why."""
        nodes = doc.get("nodes") or []
        failed = [n for n in nodes if not n.get("answered") and not n.get("cut")]
        cut = [n for n in nodes if n.get("cut")]
        if cut:
            self.print(
                f"\n{len(cut)} of {len(nodes)} node(s) cut: their answers were dropped, "
                "the command's bound on all nodes' answers together being reached:"
            )
            for n in cut:
                self.print(f"  {printable(n['node'])}")
            self.print("  (ask fewer nodes at a time with --hosts, or less of each, e.g. one --job)")
        if failed:
            self.print(f"\n{len(failed)} of {len(nodes)} node(s) did not answer:")
            for n in failed:
                self.print(f"  {n['node']}: {printable(n['error'])}")

    def value(self) -> str:
        """The text, without the last newline (``emit`` prints one)."""
        return self._buf.getvalue().removesuffix("\n")


def answered_count(doc: dict[str, Any]) -> int:
    return sum(1 for n in doc.get("nodes") or [] if n.get("answered"))


def who(row: dict[str, Any]) -> str:
    return f"rank {row.get('rank')}" if row.get("rank") is not None else f"pid {row.get('pid')}"


# -- the command -----------------------------------------------------------------------------------
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

    def client(self, args: argparse.Namespace) -> SidecarClient:
        """The sidecars' client (:func:`client_for`, looked up when called)."""
        return client_for(args)

    def collect_nodes(self, args: argparse.Namespace, nodes: list[Node]) -> Result:
        """The job-wide answer to the command's options: :meth:`collect_job` of the options
        the nodes are sent (the action's, from ``args``), reached as ``args`` say."""
        return self.collect_job(forward_options(self.name, args), nodes, reach_of(args, self.client(args)))

    def collect_job(self, options: dict[str, Any], nodes: list[Node], reach: Reach) -> Result:
        """The job-wide answer to ``options`` (the action's, checked: what the sidecar's
        job-wide action is given too), merged from the nodes' answers: the job-wide function of
        the sidecar's row of the same action."""
        job = action_of(self.name).job
        assert job is not None, f"the {self.name} action has no job-wide answer"
        result: Result = job(options, nodes, reach)
        return result

    def render(self, result: Result) -> str:
        """The text of a job-wide answer: one ``rank R on NODE: ...`` line per rank."""
        return render_per_rank(result, self.rank_line)

    def rank_line(self, row: dict[str, Any]) -> str:
        """What a rank's row of a job-wide answer says after ``rank R on NODE: ``."""
        detail = row.get("artifact") or row.get("memory_history") or row.get("error") or ""
        return f"{row.get('status')}: {detail}".rstrip(": ")


def render_per_rank(result: Result, line: Any) -> str:
    doc = result.to_json()
    text = Text()
    for r in doc["results"]:
        text.print(printable(f"{who(r)} on {r['node']}: {line(r)}"))
    text.artifacts([], doc.get("fetched"))
    text.footer(doc)
    return text.value()
