"""A job-wide answer: the nodes' answers merged into one document. The shape every job-wide answer shares::

    {"nodes": [{"node": "node-5:8787", "host": "node-5", "ok": true, "error": null, "exit_code": 0, ...}],
     "per_node": {"node-5:8787": <that node's `--json` output>, ...},
     <a top-level list over all nodes: "agents", "groups", "results", "artifacts", ...>}

A node that does not answer is named in ``nodes`` and on stderr with its reason; the others
are still merged. Exit code: 12 when some node did not answer, else the highest exit code of
the nodes' answers (0 when every node succeeded). :func:`collect_per_rank` merges the nodes'
per-rank rows (``results``) in rank order, each with its node; :class:`PerRankJob` is that
merge as an action's job-wide answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dynprof import errors
from dynprof.job.answers import node_labels, rank_key, read
from dynprof.output import printable
from dynprof.result import Result
from dynprof.tokens import read_token_file

if TYPE_CHECKING:  # the HTTP client is imported only where nodes are asked
    from dynprof.job.client import SidecarClient
    from dynprof.nodes import Node, NodeAnswer

# The same as dynprof.job.client's (a unit test holds them equal; the client is not imported
# here, so that a command run on this node only imports none of it).
DEFAULT_NODE_TIMEOUT_S = 10.0
DEFAULT_MAX_IN_FLIGHT = 64

NODES_FAILED_EXIT = errors.NodesFailed.exit_code
MAX_MESSAGES_SHOWN = 20


@dataclass
class JobResult(Result):
    """A job-level answer; ``context`` holds what its text needs beyond the ``--json``
    document (how it was asked: the options, the nodes), never part of that document."""

    context: dict[str, Any] = field(default_factory=dict)


def client_of(
    token_file: str | None,
    cacert: str | None,
    node_timeout: float = DEFAULT_NODE_TIMEOUT_S,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> SidecarClient:
    """The sidecars' client: the token of ``token_file`` (else $DYNPROF_TOKEN_FILE's), TLS
    trusting ``cacert`` when given."""
    from dynprof.job.client import SidecarClient, tls_context

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
    """Each answered node's artifact paths (``paths_of(answer)``, called for an answer whose
    result is an object), as ``{"node", "node_address", "path"}`` rows."""
    out = []
    for a in answers:
        if not a.answered:
            continue
        for path in paths_of(a) if isinstance(a.result, dict) else []:
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


class PerRank(Protocol):
    """A node's answer read by its kind (``stop``, ``memory``, ``start``): the per-rank rows a
    job-wide answer merges, and the artifacts' paths they name."""

    def rank_rows(self) -> list[dict[str, Any]]: ...

    def artifact_paths(self) -> list[Any]: ...


def per_rank_result(
    reach: Reach,
    job: str | None,
    nodes: list[Node],
    answers: list[NodeAnswer],
    decode: Callable[[Any], PerRank],
    strip: tuple[str, ...],
) -> JobResult:
    """The nodes' per-rank rows (each answer read by ``decode``, its kind's ``from_json``; an
    answer that does not read has none), merged in rank order with their node; ``per_node``
    keeps the rest of each answer (``strip``: the keys of the rows left out)."""
    labels = node_labels(nodes)
    decoded = {id(a): read(a, decode) for a in answers}
    results = []
    for a in answers:
        got = decoded[id(a)]
        for row in got.rank_rows() if got is not None else []:
            results.append({**row, "node": labels[a.node]})
    results.sort(key=rank_key)
    artifacts = artifacts_of(answers, labels, lambda a: _paths(decoded[id(a)]))
    fetched = maybe_fetch(reach, job, answers, artifacts)
    doc = {**envelope(answers, strip=strip), "results": results, "artifacts": artifacts, **fetched_doc(fetched)}
    return JobResult(doc, with_fetch(exit_code(answers), fetched), node_messages(answers))


def _paths(got: PerRank | None) -> list[Any]:
    return got.artifact_paths() if got is not None else []


def collect_per_rank(
    action: str,
    options: dict[str, Any],
    nodes: list[Node],
    reach: Reach,
    default_wait: float,
    decode: Callable[[Any], PerRank],
) -> JobResult:
    """Every node runs ``action`` with ``options`` (the action's, checked: what the sidecar's
    job-wide action is given too); their per-rank rows (``results``, each answer read by
    ``decode``) merge in rank order. A node waits its ``timeout`` option, else ``default_wait``."""
    wait = options.get("timeout") or default_wait
    answers = reach.client.action_all(nodes, action, options, timeout=wait + 5.0)
    return per_rank_result(reach, options.get("job"), nodes, answers, decode, ("results",))


@dataclass(frozen=True)
class PerRankJob:
    """The job-wide answer of action ``action`` whose nodes answer per-rank rows: called as
    ``job(options, nodes, reach)``, it is :func:`collect_per_rank` with the kind's ``decode`` (a
    node waits the ``timeout`` option, else ``default_wait``)."""

    action: str
    default_wait: float
    decode: Callable[[Any], PerRank]

    def __call__(self, options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
        return collect_per_rank(self.action, options, nodes, reach, self.default_wait, self.decode)
