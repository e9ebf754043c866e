"""Many nodes' healthcheck reports judged together: one table, peers across nodes, what to drain.

The job-wide healthcheck (:mod:`dynprof.job.healthcheck`: ``dynprof healthcheck --hosts/--slurm``
through the sidecars, ``--srun`` without them) hands in one :class:`NodeOutcome` per node: what
came back, or why nothing did. Everything here is pure: no network, no processes. Its text is
:mod:`healthcheck.fleet_text`'s.

* Every node's report is decoded by :meth:`NodeReport.from_json`, a bounded, typed reader:
  nothing a node sends is trusted (wrong types, NaN, huge lists and long text are refused, and a
  report that is refused names its node ``bad-report``, never healthy).
* **Peer comparison across nodes** (:func:`compare_peers`): each functional figure (every check
  with a ``metric``: GEMM, device memory, H2D/D2H, the intra-node all-reduce, the host's CPU and
  memory figures) is compared with the **fleet median**: the median over nodes of each node's
  own median of that figure (one vote per node, so a node with many devices, or a hostile one,
  cannot move it), among figures of the same kind (the device's SKU; for node-level figures,
  the node's device count and SKU, or the CPU model). A device (or node-level figure) more than
  ``threshold`` (default 10 %) below it makes its node ``peer-slow``, even when it passes its SKU
  baseline. Per device, not per node: a node is as fast as its slowest GPU in a synchronous job,
  and one GPU 12 % slow on a node whose other GPUs are fine is named with its index. Below
  :data:`MIN_PEER_NODES` nodes with a figure there is no median to trust: the figure is not
  compared (the report says so), and nobody is flagged by it.
* **The verdict** (:func:`judge`): the nodes to drain, each with machine-readable reasons
  (:data:`REASON_CODES`), and the exit code with one node's meanings: 0 healthy, 1 warning,
  2 some node unhealthy (drain it), 3 some node could not be checked (and none is unhealthy).
* :func:`drain_commands` prints the ``scontrol``/``kubectl`` lines for them, shell-quoted.
"""

from __future__ import annotations

import math
import re
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dynprof import __version__
from healthcheck.result import Status

SCHEMA = "dynprof.healthcheck.fleet"
SCHEMA_VERSION = 1
NODE_SCHEMA = "dynprof.healthcheck"
NODE_SCHEMA_VERSION = 1
DEFAULT_PEER_THRESHOLD = 0.10
MIN_PEER_NODES = 3

# The reason codes a node is drained for: the one list (docs/preflight.md shows it).
UNREACHABLE = "unreachable"
REFUSED = "refused"
TIMED_OUT = "timed-out"
BAD_REPORT = "bad-report"
INCOMPLETE = "incomplete"
CHECK_FAILED = "check-failed"
PEER_SLOW = "peer-slow"
LINK_SLOW = "link-slow"
LINK_HUNG = "link-hung"
LINK_FAILED = "link-failed"
REASON_CODES: dict[str, str] = {
    UNREACHABLE: "the node gave no answer: its sidecar is down or unreachable, refused the token, or its srun "
    "task printed nothing readable",
    REFUSED: "the node answered but would not run the healthcheck (a read-only sidecar, an option it refuses)",
    TIMED_OUT: "the healthcheck ran past its time limit on the node and was killed",
    BAD_REPORT: "what the node sent is not a healthcheck report this version reads (wrong schema, types or sizes)",
    INCOMPLETE: "the node's checks did not all run: a critical check is unknown (the node's own exit 3)",
    CHECK_FAILED: "a check failed on the node (the check, its device and value are given)",
    PEER_SLOW: "a functional figure is more than the peer threshold below the fleet's median (figure, median, ratio)",
    LINK_SLOW: "the node's link tests with other nodes are slower than the others' (--links: the node common to "
    "the slow pairs; bus bandwidth, median of the other pairs)",
    LINK_HUNG: "a link test with the node did not finish in its time limit (--links)",
    LINK_FAILED: "a link test with the node ended in an error, or its sidecar would not run it (--links)",
}
# The structured error types of a node that would not run the healthcheck (the others, but a
# timeout, are a healthcheck that did not finish).
REFUSING_ERRORS = frozenset({"UsageError", "Unsupported", "PermissionDenied", "Busy"})
UNKNOWN_CODES = frozenset({UNREACHABLE, REFUSED, TIMED_OUT, BAD_REPORT, INCOMPLETE})

EXIT_HEALTHY, EXIT_WARNING, EXIT_UNHEALTHY, EXIT_COULD_NOT_RUN = 0, 1, 2, 3

# Bounds of one node's report (real ones hold a few dozen checks on 8 devices).
MAX_CHECKS = 4096
MAX_DEVICES = 4096
MAX_NAME_CHARS = 64
MAX_TEXT_CHARS = 500
MAX_VALUE = 1e18
_NAME = re.compile(r"[a-z0-9_]{1,64}")
_SAFE_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_K8S_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


class ReportError(ValueError):
    """A node's report this reader refuses; the message says what is wrong with it."""


@dataclass(frozen=True)
class NodeOutcome:
    """What one node gave back, as a face hands it in.

    ``label`` is how output names the node and ``name`` the node as the scheduler knows it (the
    host of --hosts or of Slurm's node list): both from the caller, never from the node's own
    report. ``report`` is the node's ``healthcheck --json`` document (untrusted). Without an
    answer, ``error`` says why; ``error_type`` is the structured type of a command error the
    node answered with (``Timeout``, ``UsageError``, ...)."""

    label: str
    name: str
    answered: bool
    report: Any = None
    exit_code: int | None = None
    error: str | None = None
    error_type: str | None = None
    elapsed_s: float | None = None
    refused: bool = False  # no answer because the node refused the request (token, read-only, busy)


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    device: int | None
    value: float | str | None
    unit: str | None
    metric: str | None
    reason: str
    critical: bool
    correct: bool | None
    peer_group: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "device": self.device,
            "value": self.value,
            "unit": self.unit,
            "metric": self.metric,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class NodeReport:
    """The parts of a node's report the fleet reads, decoded by :meth:`from_json`."""

    host: str | None
    level: str
    exit_code: int
    duration_s: float | None
    devices: dict[int, str]  # index -> SKU
    checks: list[Check]
    artifact: str | None

    @classmethod
    def from_json(cls, doc: Any) -> NodeReport:
        if not isinstance(doc, dict):
            raise ReportError("not a JSON object")
        if doc.get("schema") != NODE_SCHEMA:
            raise ReportError(f"schema {_shown(doc.get('schema'))}, not {NODE_SCHEMA}")
        version = _int(doc.get("schema_version"), "schema_version", 1, 1 << 30)
        if version != NODE_SCHEMA_VERSION:
            raise ReportError(f"schema_version {version}; this reader reads {NODE_SCHEMA_VERSION}")
        exit_code = _int(doc.get("exit_code"), "exit_code", 0, 3)
        level = _name(doc.get("level"), "level")
        devices_doc = _list(doc.get("devices"), "devices", MAX_DEVICES)
        devices: dict[int, str] = {}
        for item in devices_doc:
            if not isinstance(item, dict):
                raise ReportError("a device is not an object")
            index = _int(item.get("index"), "a device's index", 0, MAX_DEVICES - 1)
            devices[index] = _text(item.get("sku"), "a device's sku", MAX_NAME_CHARS * 2) or "unknown"
        checks = [_check(item) for item in _list(doc.get("checks"), "checks", MAX_CHECKS)]
        if not checks:
            raise ReportError("no checks")
        duration = doc.get("duration_s")
        return cls(
            host=_text(doc.get("host"), "host", 253),
            level=level,
            exit_code=exit_code,
            duration_s=_number(duration, "duration_s") if duration is not None else None,
            devices=devices,
            checks=checks,
            artifact=_text(doc.get("artifact"), "artifact", 4096),
        )


def _shown(value: Any) -> str:
    return ascii(value)[:60]


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ReportError(f"{what} is {_shown(value)}, not an integer {low}-{high}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportError(f"{what} is {_shown(value)}, not a number")
    number = float(value)
    if not math.isfinite(number) or abs(number) > MAX_VALUE:
        raise ReportError(f"{what} is {_shown(value)}, not a finite number within +-{MAX_VALUE:g}")
    return number


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ReportError(f"{what} is {_shown(value)}, not a name of [a-z0-9_] (at most {MAX_NAME_CHARS})")
    return value


def _text(value: Any, what: str, limit: int = MAX_TEXT_CHARS) -> str | None:
    """Text (None stays None), control characters dropped, cut at ``limit``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ReportError(f"{what} is {_shown(value)}, not text")
    text = value[: limit * 4]
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:limit]


def _list(value: Any, what: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ReportError(f"{what} is not a list")
    if len(value) > limit:
        raise ReportError(f"{what}: {len(value)} items, at most {limit}")
    return value


def _check(item: Any) -> Check:
    if not isinstance(item, dict):
        raise ReportError("a check is not an object")
    name = _name(item.get("name"), "a check's name")
    try:
        status = Status(item.get("status"))
    except ValueError:
        raise ReportError(f"check {name}: status {_shown(item.get('status'))}") from None
    device_doc = item.get("device")
    device = None if device_doc is None else _int(device_doc, f"check {name}: device", 0, MAX_DEVICES - 1)
    raw = item.get("value")
    value: float | str | None
    if raw is None:
        value = None
    elif isinstance(raw, str):
        value = _text(raw, f"check {name}: value", 200)
    else:
        value = _number(raw, f"check {name}: value")
    metric_doc = item.get("metric")
    metric = None if metric_doc is None else _name(metric_doc, f"check {name}: metric")
    critical = item.get("critical", False)
    if not isinstance(critical, bool):
        raise ReportError(f"check {name}: critical is not true or false")
    details = item.get("details")
    correct: bool | None = None
    peer_group: str | None = None
    if isinstance(details, dict):
        if isinstance(details.get("correct"), bool):
            correct = details["correct"]
        group = details.get("peer_group")
        if isinstance(group, str):
            peer_group = _text(group, f"check {name}: peer_group", MAX_NAME_CHARS * 2)
    elif details is not None:
        raise ReportError(f"check {name}: details is not an object")
    return Check(
        name=name,
        status=status,
        device=device,
        value=value,
        unit=_text(item.get("unit"), f"check {name}: unit", 16),
        metric=metric,
        reason=_text(item.get("reason"), f"check {name}: reason") or "",
        critical=critical,
        correct=correct,
        peer_group=peer_group,
    )


# -- reasons and verdicts ------------------------------------------------------------------------
@dataclass(frozen=True)
class Reason:
    """Why a node is drained (or warned about): a code of :data:`REASON_CODES` and its figure."""

    code: str
    check: str | None = None
    device: int | None = None
    metric: str | None = None
    value: float | None = None
    median: float | None = None
    ratio: float | None = None
    unit: str | None = None
    nodes: int | None = None  # how many nodes the median was taken over
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}

    def short(self) -> str:
        """One line, from the code, names and numbers only (no node-written text): the drain
        commands' reason."""
        where = "" if self.device is None else f" device {self.device}"
        if self.code == PEER_SLOW and self.value is not None and self.median is not None:
            return f"{self.code} {self.metric}{where} {_fmt(self.value)} ({_pct(self.ratio)} of median {_fmt(self.median)})"
        if self.code == CHECK_FAILED:
            return f"{self.code} {self.check}{where}"
        if self.code == LINK_SLOW and self.value is not None and self.median is not None:
            return f"{self.code} busbw {_fmt(self.value)} GB/s ({_pct(self.ratio)} of median {_fmt(self.median)})"
        return self.code

    def describe(self) -> str:
        """One line for a person (may hold the node's own words, made printable)."""
        where = "" if self.device is None else f" on device {self.device}"
        unit = f" {self.unit}" if self.unit else ""
        if self.code == PEER_SLOW:
            return (
                f"{self.code}: {self.metric}{where} {_fmt(self.value)}{unit}, {_pct(self.ratio)} of the fleet "
                f"median {_fmt(self.median)}{unit} ({self.nodes} nodes)"
            )
        if self.code == LINK_SLOW and self.value is not None and self.median is not None:
            return (
                f"{self.code}: bus bandwidth {_fmt(self.value)} GB/s, {_pct(self.ratio)} of the other pairs' "
                f"median {_fmt(self.median)} GB/s: {self.detail}".rstrip(": ")
            )
        if self.code == CHECK_FAILED:
            value = "" if self.value is None else f" ({_fmt(self.value)}{unit})"
            return f"{self.code}: {self.check}{where}{value}: {self.detail}".rstrip(": ")
        return f"{self.code}: {self.detail}".rstrip(": ")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


@dataclass
class NodeVerdict:
    outcome: NodeOutcome
    report: NodeReport | None
    status: str  # healthy, warning, unhealthy, unknown
    reasons: list[Reason] = field(default_factory=list)  # why it is drained (unhealthy, unknown)
    warnings: list[Reason] = field(default_factory=list)
    slow_checks: set[str] = field(default_factory=set)

    @property
    def drain(self) -> bool:
        return self.status in ("unhealthy", "unknown")

    def check_cells(self) -> dict[str, str]:
        """The worst status of each check on this node (``slow`` where peers found it slow)."""
        order = [Status.SKIPPED, Status.PASS, Status.WARN, Status.UNKNOWN, Status.FAIL]
        worst: dict[str, Status] = {}
        for c in self.report.checks if self.report else []:
            if c.name not in worst or order.index(c.status) > order.index(worst[c.name]):
                worst[c.name] = c.status
        cells = {name: status.value for name, status in worst.items()}
        for name in self.slow_checks:
            if cells.get(name) != Status.FAIL.value:
                cells[name] = "slow"
        return cells

    def to_json(self) -> dict[str, Any]:
        r, o = self.report, self.outcome
        return {
            "node": o.label,
            "name": o.name,
            "host": r.host if r else None,
            "answered": o.answered,
            "status": self.status,
            "drain": self.drain,
            "exit_code": r.exit_code if r else o.exit_code,
            "level": r.level if r else None,
            "duration_s": r.duration_s if r else None,
            "elapsed_s": None if o.elapsed_s is None else round(o.elapsed_s, 3),
            "artifact": r.artifact if r else None,
            "error": o.error,
            "reasons": [x.to_json() for x in self.reasons],
            "warnings": [x.to_json() for x in self.warnings],
            "checks": [c.to_json() for c in r.checks] if r else [],
        }


def _verdict_of(outcome: NodeOutcome) -> NodeVerdict:
    """One node on its own: what it answered, decoded, and the reasons its own report gives."""
    if not outcome.answered:
        code = REFUSED if outcome.refused else UNREACHABLE
        return NodeVerdict(outcome, None, "unknown", [Reason(code, detail=outcome.error or "no answer")])
    if outcome.error_type is not None:
        if outcome.error_type == "Timeout":
            code = TIMED_OUT
        elif outcome.error_type in REFUSING_ERRORS:
            code = REFUSED
        else:  # killed, or ended without an answer
            code = INCOMPLETE
        return NodeVerdict(outcome, None, "unknown", [Reason(code, detail=outcome.error or outcome.error_type)])
    try:
        report = NodeReport.from_json(outcome.report)
    except ReportError as exc:
        return NodeVerdict(outcome, None, "unknown", [Reason(BAD_REPORT, detail=str(exc))])
    verdict = NodeVerdict(outcome, report, "healthy")
    for c in report.checks:
        value = c.value if isinstance(c.value, float) else None
        if c.status is Status.FAIL:
            verdict.reasons.append(
                Reason(CHECK_FAILED, c.name, c.device, c.metric, value, unit=c.unit, detail=c.reason)
            )
        elif c.status is Status.UNKNOWN and c.critical:
            verdict.reasons.append(Reason(INCOMPLETE, c.name, c.device, detail=c.reason))
        elif c.status in (Status.WARN, Status.UNKNOWN):
            verdict.warnings.append(
                Reason(c.status.value, c.name, c.device, c.metric, value, unit=c.unit, detail=c.reason)
            )
    if report.exit_code == EXIT_COULD_NOT_RUN and not verdict.reasons:
        verdict.reasons.append(Reason(INCOMPLETE, detail="the node's healthcheck could not run (exit 3)"))
    if report.exit_code == EXIT_UNHEALTHY and not any(x.code == CHECK_FAILED for x in verdict.reasons):
        verdict.reasons.append(Reason(CHECK_FAILED, detail="the node's healthcheck says unhealthy (exit 2)"))
    if any(x.code == CHECK_FAILED for x in verdict.reasons):
        verdict.status = "unhealthy"
    elif verdict.reasons:
        verdict.status = "unknown"
    elif verdict.warnings or report.exit_code == EXIT_WARNING:
        verdict.status = "warning"
    return verdict


# -- peers across nodes --------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    node: int  # index into the verdicts
    check: str
    metric: str
    device: int | None
    value: float
    unit: str | None
    group: str  # what it is compared with: the SKU, "8 x SKU" for a node's all-reduce, the CPU


def figures_of(index: int, report: NodeReport) -> list[Figure]:
    """The node's functional figures that peers can judge: measured, with a metric, and correct."""
    out = []
    skus = sorted(set(report.devices.values()))
    node_group = f"{len(report.devices)} x {', '.join(skus) or 'no devices'}"
    for c in report.checks:
        if c.metric is None or not isinstance(c.value, float) or c.correct is False:
            continue
        if c.status not in (Status.PASS, Status.WARN, Status.FAIL):
            continue
        if c.device is not None:
            group = report.devices.get(c.device, "unknown")
        else:
            group = c.peer_group or node_group
        out.append(Figure(index, c.name, c.metric, c.device, c.value, c.unit, group))
    return out


@dataclass
class PeerGroup:
    metric: str
    group: str
    per_device: bool
    unit: str | None
    nodes: int
    median: float | None
    compared: bool
    slow: int = 0

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["median"] = None if self.median is None else round(self.median, 4)
        if not self.compared:
            doc["why"] = f"{self.nodes} node(s) with this figure: at least {MIN_PEER_NODES} make a median"
        return doc


def compare_peers(
    figures: Sequence[Figure], threshold: float = DEFAULT_PEER_THRESHOLD, min_nodes: int = MIN_PEER_NODES
) -> tuple[list[tuple[int, Reason]], list[PeerGroup]]:
    """``peer-slow`` findings (node index, reason) and the groups compared.

    Per (metric, group, per device or per node): the fleet median is the median over nodes of
    each node's median of the figure; a figure below ``(1 - threshold)`` x that median is slow."""
    groups: dict[tuple[str, str, bool], list[Figure]] = {}
    for f in figures:
        groups.setdefault((f.metric, f.group, f.device is not None), []).append(f)
    findings: list[tuple[int, Reason]] = []
    summary: list[PeerGroup] = []
    for (metric, group, per_device), items in sorted(groups.items()):
        by_node: dict[int, list[float]] = {}
        for f in items:
            by_node.setdefault(f.node, []).append(f.value)
        row = PeerGroup(metric, group, per_device, items[0].unit, len(by_node), None, False)
        summary.append(row)
        if len(by_node) < min_nodes:
            continue
        median = statistics.median(statistics.median(values) for values in by_node.values())
        row.median = median
        if median <= 0:
            continue
        row.compared = True
        for f in items:
            ratio = f.value / median
            if ratio < 1 - threshold:
                row.slow += 1
                findings.append(
                    (
                        f.node,
                        Reason(
                            PEER_SLOW,
                            f.check,
                            f.device,
                            metric,
                            round(f.value, 4),
                            round(median, 4),
                            round(ratio, 4),
                            f.unit,
                            len(by_node),
                        ),
                    )
                )
    return findings, summary


# -- the whole fleet ---------------------------------------------------------------------------------
@dataclass
class FleetReport:
    verdicts: list[NodeVerdict]
    peers: list[PeerGroup]
    threshold: float
    level: str | None = None
    duration_s: float | None = None
    how: str = "sidecars"  # or "srun"
    links: dict[str, Any] | None = None  # the link tests' document (--links), as run_link_rounds wrote it

    @property
    def exit_code(self) -> int:
        """As one node's: 2 when a node is unhealthy, else 3 when one could not be checked, else
        1 when one warns, else 0; 3 when there is no node at all."""
        statuses = {v.status for v in self.verdicts}
        if not self.verdicts:
            return EXIT_COULD_NOT_RUN
        if "unhealthy" in statuses:
            return EXIT_UNHEALTHY
        if "unknown" in statuses:
            return EXIT_COULD_NOT_RUN
        if "warning" in statuses:
            return EXIT_WARNING
        return EXIT_HEALTHY

    @property
    def verdict(self) -> str:
        return {0: "healthy", 1: "warning", 2: "unhealthy", 3: "could not run"}[self.exit_code]

    def drained(self) -> list[NodeVerdict]:
        return [v for v in self.verdicts if v.drain]

    def counts(self) -> dict[str, int]:
        out = {"nodes": len(self.verdicts)}
        for status in ("healthy", "warning", "unhealthy", "unknown"):
            out[status] = sum(1 for v in self.verdicts if v.status == status)
        out["drain"] = len(self.drained())
        return out

    def to_json(self, drain_kind: str | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "dynprof_version": __version__,
            "how": self.how,
            "level": self.level,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "peer": {
                "threshold": self.threshold,
                "min_nodes": MIN_PEER_NODES,
                "figures": [p.to_json() for p in self.peers],
            },
            "drain": [
                {"node": v.outcome.label, "name": v.outcome.name, "reasons": [x.to_json() for x in v.reasons]}
                for v in self.drained()
            ],
            "nodes": [v.to_json() for v in self.verdicts],
            "links": self.links,
        }
        if drain_kind is not None:
            doc["drain_commands"] = drain_commands(self, drain_kind)
        return doc


def judge(
    outcomes: Sequence[NodeOutcome],
    threshold: float = DEFAULT_PEER_THRESHOLD,
    level: str | None = None,
    duration_s: float | None = None,
    how: str = "sidecars",
) -> FleetReport:
    """Every node's answer decoded and judged, then the peers compared across nodes."""
    verdicts = [_verdict_of(o) for o in outcomes]
    figures = [f for i, v in enumerate(verdicts) if v.report for f in figures_of(i, v.report)]
    findings, peers = compare_peers(figures, threshold)
    for index, reason in findings:
        v = verdicts[index]
        v.reasons.append(reason)
        if reason.check:
            v.slow_checks.add(reason.check)
        if v.status in ("healthy", "warning"):
            v.status = "unhealthy"
        elif v.status == "unknown":
            v.status = "unhealthy"  # a node that is slow is unhealthy, whatever else it could not run
    return FleetReport(verdicts, peers, threshold, level, duration_s, how)


def add_link_findings(report: FleetReport, findings: Sequence[tuple[int, Any]], links_doc: dict[str, Any]) -> None:
    """The link tests' findings (``(index of the node's verdict, LinkFinding)``) joined to the
    nodes' verdicts: a node the tests isolate is unhealthy (slow, hung) or not checked
    (failed); one they could not tell from its partner is warned about (its own checks decide)."""
    report.links = links_doc
    for index, finding in findings:
        if not 0 <= index < len(report.verdicts):
            continue
        v = report.verdicts[index]
        code = finding.code if finding.code in (LINK_SLOW, LINK_HUNG, LINK_FAILED) else LINK_FAILED
        reason = Reason(
            code,
            check="links",
            metric="busbw" if finding.busbw_gbps is not None else None,
            value=finding.busbw_gbps,
            median=finding.median_gbps,
            ratio=(finding.busbw_gbps / finding.median_gbps) if finding.busbw_gbps and finding.median_gbps else None,
            unit="GB/s" if finding.busbw_gbps is not None else None,
            detail=finding.message,
        )
        if not finding.isolated:
            v.warnings.append(reason)
            if v.status == "healthy":
                v.status = "warning"
            continue
        v.reasons.append(reason)
        v.slow_checks.add("links")
        if code == LINK_FAILED:
            if v.status in ("healthy", "warning"):
                v.status = "unknown"
        else:
            v.status = "unhealthy"


# -- drain lines -----------------------------------------------------------------------------------
DRAIN_KINDS = ("slurm", "k8s")
TAINT_KEY = "dynprof.io/preflight"
MAX_REASON_CHARS = 200


def drain_reason(verdict: NodeVerdict) -> str:
    """The scheduler's reason text: codes, check and metric names and numbers only."""
    text = "dynprof preflight: " + "; ".join(dict.fromkeys(r.short() for r in verdict.reasons))
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def drain_commands(report: FleetReport, kind: str) -> list[str]:
    """The lines that drain (``slurm``) or cordon and taint (``k8s``) each node to drain, quoted
    for a POSIX shell; printed, never run. A node whose name no scheduler takes as a node name
    gets a comment line instead (its name escaped), to drain by hand."""
    if kind not in DRAIN_KINDS:
        raise ValueError(f"drain commands for {DRAIN_KINDS}, not {kind!r}")
    lines = []
    for v in report.drained():
        name = v.outcome.name
        if not _SAFE_NODE_NAME.fullmatch(name):
            lines.append(f"# {ascii(name)[:120]}: not a node name {kind} takes; drain it by hand ({drain_reason(v)})")
            continue
        reason = drain_reason(v)
        if kind == "slurm":
            lines.append(shlex.join(["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}"]))
        else:
            code = v.reasons[0].code if v.reasons else "unhealthy"
            value = code if _K8S_VALUE.fullmatch(code) else "unhealthy"
            lines.append(shlex.join(["kubectl", "cordon", name]))
            lines.append(
                shlex.join(["kubectl", "taint", "nodes", name, f"{TAINT_KEY}={value}:NoSchedule", "--overwrite"])
            )
    return lines
