"""Link tests between nodes, in rounds, through the nodes' sidecars; the slow node named.

:func:`run_link_rounds` is the entry of the job-wide healthcheck's link part. Each round
(:class:`~healthcheck.links.scheme.LinkSearch` plans them) runs every group's test at once:
each member node runs its side through its sidecar's ``link-test`` action (a child process
there, which runs the torch.distributed worker in a process group of its own, killed past
the round's limit). Rank 0 of a group (its first node) hosts the rendezvous, a TCPStore on
``store_port + (r - 1) * (n // 2) + i`` (round ``r``, ``i`` the group's index in the round:
distinct ports, so simulated nodes sharing an address, or a side that ended late, never
collide) of its own node; the others connect
to it at the address the orchestrator reaches that node's sidecar by. So the rendezvous and
the test run between the compute nodes only: the orchestrator (a login node behind a
firewall, say) needs to reach the sidecars and nothing else.

A round ends when every side has answered, or at ``round_limit_s`` plus a margin
(:data:`ROUND_MARGIN_S`: the sidecar's child and the worker starting): a side not answered by
then counts as hung. A group's figure is its bus bandwidth (GB/s; sendrecv: algbw, factor 1;
allreduce: 2 (n - 1) / n), the slowest side's; a group with a hung side is ``hung``, one
with a failed side (and none hung) ``failed``; neither has a figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from dynprof.nodes import Node, NodeAnswer
from healthcheck.links.scheme import DEFAULT_THRESHOLD, Group, LinkSearch

LINKS_SCHEMA = "dynprof.healthcheck.links"
LINKS_SCHEMA_VERSION = 1
ACTION = "link-test"
ROUND_MARGIN_S = 15.0
DEFAULT_ROUND_LIMIT_S = 60.0
DEFAULT_STORE_PORT = 29720
DEFAULT_SIZE_BYTES = 64 * 1024 * 1024
# the timed iterations of a round's tests begin together, this long after the round starts
# (the sidecars' children and the workers start, rendezvous and warm up before it)
DEFAULT_START_DELAY_S = 10.0
MAX_SIDES_AT_ONCE = 4096  # every side of a round must run at once, or its peers wait for it

CODE_SLOW = "link-slow"
CODE_HUNG = "link-hung"
CODE_FAILED = "link-failed"


class ActionClient(Protocol):
    """What the rounds need of :class:`dynprof.job.client.SidecarClient`."""

    def action(self, node: Node, name: str, options: dict[str, Any], timeout: float | None = None) -> NodeAnswer: ...


@dataclass
class SideAnswer:
    node: str
    host: str
    rank: int
    status: str  # ok, hung, failed, no-answer
    busbw_gbps: float | None = None
    wall_s: float | None = None
    error: str | None = None
    late_s: float | None = None  # how late it came to the round's common start (it then began at once)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GroupResult:
    round: int
    members: Group
    nodes: list[str]
    hosts: list[str]
    status: str  # ok, slow, hung, failed
    busbw_gbps: float | None
    reference_gbps: float | None = None
    sides: list[SideAnswer] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "nodes": self.nodes,
            "hosts": self.hosts,
            "status": self.status,
            "busbw_gbps": _round(self.busbw_gbps),
            "reference_gbps": _round(self.reference_gbps),
            "wall_s": round(self.wall_s, 3),
            "sides": [s.to_json() for s in self.sides],
        }


@dataclass
class LinkFinding:
    """A node the link tests name (``isolated``), or one of the nodes of a slow or hung test
    that links alone could not tell apart (``isolated`` False: look at the node checks)."""

    host: str
    node: str
    code: str  # link-slow, link-hung, link-failed
    isolated: bool
    busbw_gbps: float | None
    median_gbps: float | None  # the median of the other tests of its round
    baseline_gbps: float | None
    pairs: list[dict[str, Any]]
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "node": self.node,
            "code": self.code,
            "isolated": self.isolated,
            "busbw_gbps": _round(self.busbw_gbps),
            "median_gbps": _round(self.median_gbps),
            "baseline_gbps": _round(self.baseline_gbps),
            "pairs": self.pairs,
            "message": self.message,
        }


@dataclass
class LinkReport:
    nodes: list[str]
    backend: str
    pattern: str
    size_bytes: int
    threshold: float
    baseline_gbps: float | None
    round_limit_s: float
    rounds: list[list[GroupResult]] = field(default_factory=list)
    round_wall_s: list[float] = field(default_factory=list)
    findings: list[LinkFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": LINKS_SCHEMA,
            "schema_version": LINKS_SCHEMA_VERSION,
            "ok": self.ok,
            "nodes": self.nodes,
            "backend": self.backend,
            "pattern": self.pattern,
            "bus_factor": "sendrecv: busbw = algbw (1); allreduce: busbw = algbw * 2(n-1)/n",
            "size_bytes": self.size_bytes,
            "threshold": self.threshold,
            "baseline_gbps": self.baseline_gbps,
            "round_limit_s": self.round_limit_s,
            "rounds": [
                {"round": i + 1, "wall_s": round(w, 3), "groups": [g.to_json() for g in groups]}
                for i, (groups, w) in enumerate(zip(self.rounds, self.round_wall_s, strict=True))
            ],
            "findings": [f.to_json() for f in self.findings],
            "notes": self.notes,
            "wall_s": round(self.wall_s, 3),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def run_link_rounds(
    nodes: Sequence[Node],
    client: ActionClient,
    *,
    backend: str = "auto",
    size_bytes: int = DEFAULT_SIZE_BYTES,
    round_limit_s: float = DEFAULT_ROUND_LIMIT_S,
    progress: Callable[[str], None] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    baseline_gbps: float | None = None,
    pattern: str = "sendrecv",
    iters: int = 10,
    warmup: int = 2,
    store_port: int = DEFAULT_STORE_PORT,
    start_delay_s: float = DEFAULT_START_DELAY_S,
) -> LinkReport:
    """Test the links between ``nodes`` in rounds and name the slow node (see the module doc).

    ``baseline_gbps`` is the SKU's link bus bandwidth where a baseline has one: a test below
    ``(1 - threshold) * baseline_gbps`` is slow whatever the others measure. Never raises for
    what a node does: a node that does not answer, a test that hangs or fails are findings.
    ``start_delay_s`` after a round starts, all its tests begin their timed iterations at
    once (epoch time: the nodes' clocks are assumed NTP-synchronised; 0: each at once)."""
    started = time.monotonic()
    say = progress or (lambda line: None)
    labels = [n.address for n in nodes]
    hosts = [n.host for n in nodes]
    floor = None if baseline_gbps is None else (1.0 - threshold) * baseline_gbps
    report = LinkReport(labels, backend, pattern, size_bytes, threshold, baseline_gbps, round_limit_s)
    search = LinkSearch(len(nodes), threshold=threshold, floor=floor)
    if len(nodes) < 2:
        report.notes.append("links need 2 nodes or more: nothing tested")
    options = {"backend": backend, "pattern": pattern, "size": size_bytes, "iters": iters, "warmup": warmup}
    while (groups := search.next_round()) is not None:
        number = len(search.rounds) + 1
        say(f"links: round {number}: {len(groups)} tests at once, limit {round_limit_s:g} s")
        t0 = time.monotonic()
        # a port block per round: a side of the last round that its node ended late (a loaded
        # node) cannot hold the port of this round's test
        port = store_port + (number - 1) * max(1, len(nodes) // 2)
        start_at = time.time() + start_delay_s if start_delay_s > 0 else 0.0
        results = _run_round(nodes, client, groups, number, {**options, "start_at": start_at}, round_limit_s, port)
        for result in results:  # the sidecars' names where they gave one
            for side, member in zip(result.sides, result.members, strict=True):
                if side.host:
                    hosts[member] = side.host
        outcome = search.record([r.busbw_gbps if r.status == "ok" else None for r in results])
        for result, slow, ref in zip(results, outcome.slow, outcome.references, strict=True):
            result.reference_gbps = ref
            result.hosts = [hosts[m] for m in result.members]
            if slow and result.status == "ok":
                result.status = "slow"
        report.rounds.append(results)
        report.round_wall_s.append(time.monotonic() - t0)
        slow_count = sum(1 for r in results if r.status != "ok")
        say(f"links: round {number}: {slow_count} of {len(results)} tests slow, hung or failed")
    report.findings = _findings(search, report, labels, hosts)
    if len(nodes) == 2 and baseline_gbps is None:
        report.notes.append("2 nodes and no baseline: the one pair is judged by hung or failed only")
    report.wall_s = time.monotonic() - started
    return report


def _run_round(
    nodes: Sequence[Node],
    client: ActionClient,
    groups: list[Group],
    number: int,
    options: dict[str, Any],
    limit_s: float,
    store_port: int,
) -> list[GroupResult]:
    sides: list[tuple[int, int, int]] = [(gi, rank, m) for gi, g in enumerate(groups) for rank, m in enumerate(g)]
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(sides), MAX_SIDES_AT_ONCE)), thread_name_prefix="dynprof-link")
    futures: list[Future[NodeAnswer]] = []
    started = time.monotonic()
    try:
        for gi, rank, member in sides:
            group = groups[gi]
            opts = {
                **options,
                "rank": rank,
                "world": len(group),
                "store_host": nodes[group[0]].host,
                "store_port": store_port + gi,
                "limit": limit_s,
            }
            futures.append(pool.submit(client.action, nodes[member], ACTION, opts, limit_s + ROUND_MARGIN_S / 2))
        wait_futures(futures, timeout=limit_s + ROUND_MARGIN_S)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a side past the round's end is hung
    answers: list[list[SideAnswer]] = [[] for _ in groups]
    for (gi, rank, member), future in zip(sides, futures, strict=True):
        answers[gi].append(_side_answer(nodes[member], rank, future, limit_s))
    elapsed = time.monotonic() - started
    results = []
    for gi, group in enumerate(groups):
        group_sides = answers[gi]
        statuses = {s.status for s in group_sides}
        figure: float | None = None
        if "hung" in statuses or "no-answer" in statuses:
            status = "hung"
        elif "failed" in statuses:
            status = "failed"
        else:
            status = "ok"
            figure = min(s.busbw_gbps for s in group_sides if s.busbw_gbps is not None)
        walls = [s.wall_s for s in group_sides if s.wall_s is not None]
        results.append(
            GroupResult(
                number,
                group,
                [nodes[m].address for m in group],
                [s.host for s in group_sides],
                status,
                figure,
                sides=group_sides,
                wall_s=max(walls) if walls else elapsed,
            )
        )
    return results


def _side_answer(node: Node, rank: int, future: Future[NodeAnswer], limit_s: float) -> SideAnswer:
    label = node.address
    if not future.done():
        return SideAnswer(label, node.host, rank, "hung", error=f"no answer within the round's limit ({limit_s:g} s)")
    try:
        answer = future.result()
    except Exception as exc:  # a client bug must not end the rounds
        return SideAnswer(label, node.host, rank, "failed", error=f"{type(exc).__name__}: {exc}")
    host = answer.host if isinstance(answer.host, str) and answer.host else node.host
    if not answer.answered:
        # a sidecar that refused or could not be reached answers at once: the test failed; one
        # that kept the request past the limit (stopped, or a network that drops) is hung
        silent = "no-answer" if answer.elapsed_s >= limit_s else "failed"
        return SideAnswer(label, host, rank, silent, error=answer.error)
    doc = answer.result if isinstance(answer.result, dict) else {}
    status = doc.get("status")
    wall = doc.get("wall_s")
    wall_s = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None
    if status == "ok":
        busbw = doc.get("busbw_gbps")
        late = doc.get("late_s")
        late_s = float(late) if isinstance(late, (int, float)) and not isinstance(late, bool) else None
        if isinstance(busbw, (int, float)) and not isinstance(busbw, bool) and busbw >= 0:
            return SideAnswer(label, host, rank, "ok", float(busbw), wall_s, late_s=late_s)
        return SideAnswer(label, host, rank, "failed", wall_s=wall_s, error="its answer has no bandwidth")
    if status == "hung" or answer.exit_code == 9:
        return SideAnswer(
            label, host, rank, "hung", wall_s=wall_s, error=str(doc.get("error") or answer.command_error())[:2000]
        )
    why = doc.get("error") or answer.command_error() or f"exit {answer.exit_code}"
    return SideAnswer(label, host, rank, "failed", wall_s=wall_s, error=str(why)[:2000])


_CODES = {"slow": CODE_SLOW, "hung": CODE_HUNG, "failed": CODE_FAILED}


def _findings(search: LinkSearch, report: LinkReport, labels: list[str], hosts: list[str]) -> list[LinkFinding]:
    by_round = report.rounds

    def involving(node: int) -> list[dict[str, Any]]:
        return [
            {"round": g.round, "hosts": g.hosts, "status": g.status, "busbw_gbps": _round(g.busbw_gbps)}
            for groups in by_round
            for g in groups
            if node in g.members
        ]

    def group_of(number: int, members: Group) -> GroupResult | None:
        for g in by_round[number - 1] if 0 < number <= len(by_round) else []:
            if g.members == members:
                return g
        return None

    def first_bad(node: int) -> GroupResult | None:
        for groups in by_round:
            for g in groups:
                if node in g.members and g.status != "ok":
                    return g
        return None

    findings: list[LinkFinding] = []
    for named in search.named:
        evidence = group_of(named.round, named.group) if named.group is not None else first_bad(named.node)
        if evidence is None or evidence.status == "ok":
            evidence = first_bad(named.node)
        status = evidence.status if evidence is not None else "slow"
        how = "the one node common to the slow tests" if not named.by_elimination else "the one member not cleared"
        figure = evidence.busbw_gbps if evidence else None
        what = f"{figure:.3f} GB/s" if figure is not None else status
        ref = evidence.reference_gbps if evidence else None
        against = f" against a median of {ref:.3f} GB/s" if ref is not None else ""
        findings.append(
            LinkFinding(
                hosts[named.node],
                labels[named.node],
                _CODES.get(status, CODE_SLOW),
                True,
                figure,
                ref,
                report.baseline_gbps,
                involving(named.node),
                f"{hosts[named.node]}: link test {what}{against} ({how}, round {named.round})",
            )
        )
    for node in search.unresolved:
        bad = first_bad(node)
        status = bad.status if bad is not None else "slow"
        findings.append(
            LinkFinding(
                hosts[node],
                labels[node],
                _CODES.get(status, CODE_SLOW),
                False,
                bad.busbw_gbps if bad else None,
                bad.reference_gbps if bad else None,
                report.baseline_gbps,
                involving(node),
                f"{hosts[node]}: in a {status} link test that links alone cannot pin on one node "
                "(too few nodes, or too few healthy partners): see its node checks",
            )
        )
    for group in search.slow_links:
        last = group_of(len(by_round), group)
        others = ", ".join(hosts[m] for m in group)
        for node in group:
            findings.append(
                LinkFinding(
                    hosts[node],
                    labels[node],
                    _CODES.get(last.status if last else "slow", CODE_SLOW),
                    False,
                    last.busbw_gbps if last else None,
                    last.reference_gbps if last else None,
                    report.baseline_gbps,
                    involving(node),
                    f"the link between {others} is slow twice while each node is fast with others: a path, not a node",
                )
            )
    return findings


def median_figure(report: LinkReport) -> float | None:
    """The median bus bandwidth of the report's healthy tests (for a summary)."""
    figures = [
        g.busbw_gbps for groups in report.rounds for g in groups if g.status == "ok" and g.busbw_gbps is not None
    ]
    return statistics.median(figures) if figures else None
