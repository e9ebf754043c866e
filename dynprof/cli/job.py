"""The shape every job-level command shares (``ps``, ``ls``, ``stacks``, ``start``, ``stop``,
``memory``, ``nccl``): on this node's agents, or, given nodes (``--hosts``, ``--hostfile``,
``--slurm``, ``--discover``), on every node's through their sidecars.

A subclass adds its own options (:meth:`JobCommand.add_arguments`) and answers both ways:
:meth:`collect_local` (this node's; the sidecar's action of the same name collects the same
request) and :meth:`collect_job` (the job-wide answer to the action's options, merged from the
nodes' answers; the CLI's ``--hosts`` and the sidecar's job-wide action both call it).
The dispatch between them, and the node options, are here once.

Job-wide, each node's sidecar runs the command with the command's own options (one level
only: never the node options themselves) and the answers merge::

    {"nodes": [{"node": "node-5:8787", "host": "node-5", "ok": true, "error": null, "exit_code": 0, ...}],
     "per_node": {"node-5:8787": <that node's `--json` output>, ...},
     <a top-level list over all nodes: "agents", "groups", "results", "artifacts", ...>}

A node that does not answer is named in ``nodes`` and on stderr with its reason; the others
are still merged. Exit code: 12 when some node did not answer, else the highest exit code of
the nodes' commands (0 when every node succeeded). The default :meth:`JobCommand.collect_job`
merges the nodes' per-rank rows (``results``) in rank order, each with its node.
"""

from __future__ import annotations

import argparse
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dynprof import errors
from dynprof.cli._common import add_json, printable
from dynprof.cli._node_args import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_NODE_TIMEOUT_S,
    add_many_node_args,
    nodes_requested,
)
from dynprof.nodes import Node
from dynprof.result import Result

if TYPE_CHECKING:  # the HTTP client is imported only where nodes are asked
    from dynprof.job.client import SidecarClient
    from dynprof.nodes import NodeAnswer

NODES_FAILED_EXIT = errors.NodesFailed.exit_code
MAX_MESSAGES_SHOWN = 20


@dataclass
class JobResult(Result):
    """A job-level command's answer; ``context`` holds what its text needs beyond the ``--json``
    document (how it was asked: the options, the nodes), never part of that document."""

    context: dict[str, Any] = field(default_factory=dict)


def client_for(args: argparse.Namespace) -> SidecarClient:
    """The sidecars' client, with the token and TLS the options name."""
    return client_of(args.token_file, args.cacert, args.node_timeout, args.max_in_flight)


def client_of(
    token_file: str | None,
    cacert: str | None,
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> SidecarClient:
    """The sidecars' client: the token of ``token_file`` (else $DYNPROF_TOKEN_FILE's), TLS
    trusting ``cacert`` when given."""
    from dynprof.job.client import SidecarClient, tls_context
    from dynprof.tokens import read_token_file

    path = token_file or os.environ.get("DYNPROF_TOKEN_FILE") or None
    if not path:
        raise errors.UsageError(
            "the sidecars need their access token",
            help="Give --token-file FILE (mode 0600) or set DYNPROF_TOKEN_FILE, as for `dynprof serve`.",
        )
    token = read_token_file(path)
    tls = tls_context(cacert) if cacert else None
    return SidecarClient(token, tls=tls, timeout=node_timeout, max_in_flight=max_in_flight)


@dataclass(frozen=True)
class Reach:
    """How a job-wide answer reaches the nodes, and what it does besides its document: the
    sidecars' ``client``; ``fetch``, the directory the nodes' artifacts are copied into (the
    CLI's --fetch; None: not copied); ``progress`` on stderr (a person is watching);
    ``node_timeout``, the seconds each node has beyond the command's own wait."""

    client: SidecarClient
    fetch: str | None = None
    progress: bool = False
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S


def reach_of(args: argparse.Namespace, client: SidecarClient) -> Reach:
    """The CLI's reach: its --fetch, progress unless --json, its --node-timeout."""
    return Reach(
        client,
        fetch=getattr(args, "fetch", None) or None,
        progress=not getattr(args, "json", False),
        node_timeout=getattr(args, "node_timeout", DEFAULT_NODE_TIMEOUT_S),
    )


def forward_options(name: str, args: argparse.Namespace, **override: Any) -> dict[str, Any]:
    """The command's own options, as action ``name`` takes them (unset ones left out)."""
    from dynprof.sidecar.actions import ACTIONS

    out: dict[str, Any] = {}
    for key in ACTIONS[name].options:
        value = override[key] if key in override else getattr(args, key, None)
        if value is None or value is False or value == []:
            continue
        out[key] = value
    return out


def default_timeout(name: str) -> float:
    from dynprof.sidecar.actions import ACTIONS

    return float(ACTIONS[name].default_timeout_s)


# -- the nodes' answers ------------------------------------------------------------------------
def exit_code(answers: list[NodeAnswer]) -> int:
    if any(not a.answered for a in answers):
        return NODES_FAILED_EXIT
    return max((a.exit_code or 0 for a in answers), default=0)


def with_fetch(code: int, fetched: list[dict[str, Any]] | None) -> int:
    """An artifact that could not be fetched makes a command that otherwise succeeded exit 1."""
    return 1 if code == 0 and fetched and any(f["error"] for f in fetched) else code


def node_messages(answers: list[NodeAnswer]) -> list[str]:
    """For stderr: why each node did not answer, and what each node's command said there
    (its warnings and errors, with their `what to do`)."""
    out = []
    for a in answers:
        if not a.answered:
            out.append(f"node {a.node}: {printable(a.error)}")
            continue
        for line in a.messages[:MAX_MESSAGES_SHOWN]:
            out.append(f"node {a.node}: {printable(line.removeprefix('dynprof: '))}")
        if len(a.messages) > MAX_MESSAGES_SHOWN:
            out.append(f"node {a.node}: ... {len(a.messages) - MAX_MESSAGES_SHOWN} more line(s)")
        if a.exit_code and not a.messages:
            out.append(f"node {a.node}: exit {a.exit_code}")
    return out


def envelope(answers: list[NodeAnswer], strip: tuple[str, ...] = ()) -> dict[str, Any]:
    per_node: dict[str, Any] = {}
    for a in answers:
        result = a.result
        if strip and isinstance(result, dict):
            result = {k: v for k, v in result.items() if k not in strip}
        per_node[a.node.address] = result
    return {"nodes": [a.summary(a.node.address) for a in answers], "per_node": per_node}


def artifacts_of(answers: list[NodeAnswer], labels: dict[Node, str], paths_of: Any) -> list[dict[str, Any]]:
    """Each answered node's artifact paths, as ``{"node", "node_address", "path"}`` rows."""
    out = []
    for a in answers:
        if not a.answered:
            continue
        for path in paths_of(a.result) if isinstance(a.result, dict) else []:
            if isinstance(path, str) and path:
                out.append({"node": labels[a.node], "node_address": a.node.address, "path": path[:4096]})
    return out


def maybe_fetch(
    reach: Reach, job: str | None, answers: list[NodeAnswer], artifacts: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """With ``reach.fetch`` (--fetch DIR), the artifacts copied into DIR (one row each); else
    None. Either way the rows lose their ``node_address`` (not part of the answer)."""
    from dynprof.job.fetch import fetch_by_path

    fetch_dir = reach.fetch
    if not fetch_dir:
        for art in artifacts:
            art.pop("node_address", None)
        return None
    # The answers name artifacts by their path on the node; the node's own listing gives the ids.
    by_node: dict[str, list[str]] = {}
    for art in artifacts:
        by_node.setdefault(art.pop("node_address"), []).append(art["path"])
    return fetch_by_path(reach.client, Path(fetch_dir), answers, by_node, job)


def fetched_doc(fetched: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"fetched": fetched} if fetched is not None else {}


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
        """Every node runs the command with ``options`` (the action's, checked: what the
        sidecar's job-wide action is given too); their per-rank rows (``results``) merge in
        rank order."""
        wait = options.get("timeout") or default_timeout(self.name)
        answers = reach.client.action_all(nodes, self.name, options, timeout=wait + 5.0)
        return per_rank_result(reach, options.get("job"), nodes, answers, ("results",))

    def render(self, result: Result) -> str:
        """The text of a job-wide answer: one ``rank R on NODE: ...`` line per rank."""
        return render_per_rank(result, self.rank_line)

    def rank_line(self, row: dict[str, Any]) -> str:
        """What a rank's row of a job-wide answer says after ``rank R on NODE: ``."""
        detail = row.get("artifact") or row.get("memory_history") or row.get("error") or ""
        return f"{row.get('status')}: {detail}".rstrip(": ")


def per_rank_result(
    reach: Reach,
    job: str | None,
    nodes: list[Node],
    answers: list[NodeAnswer],
    keys: tuple[str, ...],
) -> JobResult:
    """The nodes' per-rank rows (under the first of ``keys`` a node's answer has), merged in
    rank order with their node."""
    from dynprof.job.answers import node_labels, rank_key, rows, rows_of

    labels = node_labels(nodes)
    results = []
    for a in answers:
        for row in next((found for found in (rows(a, k) for k in keys) if found), []):
            row["node"] = labels[a.node]
            results.append(row)
    results.sort(key=rank_key)
    artifacts = artifacts_of(answers, labels, lambda r: [x.get("artifact") for x in rows_of(r, "results")])
    fetched = maybe_fetch(reach, job, answers, artifacts)
    doc = {**envelope(answers, strip=keys), "results": results, "artifacts": artifacts, **fetched_doc(fetched)}
    return JobResult(doc, with_fetch(exit_code(answers), fetched), node_messages(answers))


def render_per_rank(result: Result, line: Any) -> str:
    doc = result.to_json()
    text = Text()
    for r in doc["results"]:
        text.print(printable(f"{who(r)} on {r['node']}: {line(r)}"))
    text.artifacts([], doc.get("fetched"))
    text.footer(doc)
    return text.value()
