"""A run's report and its renderings: a table for people, JSON and Prometheus text for machines.

The JSON document (schema ``dynprof.healthcheck``, version :data:`SCHEMA_VERSION`) is a stable
contract: fields are only ever added within a version. See docs/healthcheck.md.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynprof import __version__
from dynprof.output import table
from healthcheck.result import CheckResult, Status, exit_code, verdict

SCHEMA = "dynprof.healthcheck"
SCHEMA_VERSION = 1

# Prometheus encoding of a check's status.
STATUS_CODES = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.UNKNOWN: 3, Status.SKIPPED: -1}


@dataclass
class DeviceSummary:
    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_gib: int | None
    sku: str
    baseline: str | None = None


@dataclass
class Report:
    level: str
    backend: str | None
    started_at: str
    duration_s: float
    checks: list[CheckResult]
    devices: list[DeviceSummary] = field(default_factory=list)
    driver_version: str | None = None
    host: str = field(default_factory=socket.gethostname)
    options: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    @property
    def verdict(self) -> str:
        return verdict(self.exit_code)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for c in self.checks if c.status is s) for s in Status}

    def device_actions(self) -> dict[str, str]:
        """For each device (and ``node``) the strongest action a failing check asks for."""
        order = {"reset": 1, "drain": 2}
        actions: dict[str, str] = {}
        for c in self.checks:
            if c.status is Status.FAIL and c.action in order:
                key = "node" if c.device is None else str(c.device)
                if order[c.action] > order.get(actions.get(key, ""), 0):
                    actions[key] = c.action
        return actions

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "dynprof_version": __version__,
            "host": self.host,
            "level": self.level,
            "backend": self.backend,
            "driver_version": self.driver_version,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "actions": self.device_actions(),
            "devices": [d.__dict__ for d in self.devices],
            "checks": [c.to_json() for c in self.checks],
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "options": self.options,
        }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def render_table(report: Report, show_passed: bool = True) -> str:
    rows = []
    for c in report.checks:
        if not show_passed and c.status in (Status.PASS, Status.SKIPPED):
            continue
        value = _fmt(c.value) + (f" {c.unit}" if c.unit and c.value is not None else "")
        rows.append(
            [
                c.name,
                "node" if c.device is None else c.device,
                c.status.value.upper(),
                value,
                c.expected or "",
                c.reason,
            ]
        )
    skus = sorted({d.sku for d in report.devices})
    head = (
        f"dynprof healthcheck: {report.host}, level {report.level}, backend {report.backend or 'none'}, "
        f"{len(report.devices)} devices" + (f" ({', '.join(skus)})" if skus else "") + f", {report.duration_s:.1f} s"
    )
    counts = report.counts()
    tail = f"verdict: {report.verdict.upper()} (exit {report.exit_code}); " + ", ".join(
        f"{n} {s}" for s, n in counts.items() if n
    )
    helps = sorted(
        {str(c.details["help"]) for c in report.checks if c.status is not Status.PASS and "help" in c.details}
    )
    for text in helps:
        tail += f"\nwhat to do: {text}"
    actions = report.device_actions()
    if actions:
        tail += "\nactions: " + ", ".join(
            f"{'device ' + k if k != 'node' else 'node'}: {v}" for k, v in actions.items()
        )
    return "\n".join([head, "", table(rows, ["CHECK", "DEVICE", "STATUS", "VALUE", "EXPECTED", "REASON"]), "", tail])


def render_prometheus(report: Report) -> str:
    """Prometheus text exposition format, for node_exporter's textfile collector, written by
    ``prometheus_client`` from a private registry. (It is written to its file by
    :func:`write_atomically`, not the library's ``write_to_textfile``: that one renames a
    temporary file over the target, which would replace ``/dev/stdout`` or a FIFO when run as
    root.) The library writes label pairs sorted by name and values as floats (``2.0``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_HealthcheckCollector(report))
    return generate_latest(registry).decode("utf-8")


class _HealthcheckCollector:
    """The metric families of one report (a ``prometheus_client`` collector)."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily, Metric

        report = self.report
        host, level = str(report.host), str(report.level)
        exit_family = GaugeMetricFamily(
            "dynprof_healthcheck_exit_code",
            "Exit code of the last healthcheck: 0 healthy, 1 warning, 2 unhealthy, 3 could not run.",
            labels=["host", "level"],
        )
        exit_family.add_metric([host, level], report.exit_code)
        yield exit_family
        duration = GaugeMetricFamily(
            "dynprof_healthcheck_duration_seconds", "Wall time of the last healthcheck.", labels=["host", "level"]
        )
        duration.add_metric([host, level], round(report.duration_s, 3))
        yield duration
        # One series per check and device (and path or port); where a check has several results
        # for the same labels, the worst status is exported. Label sets differ by check (path,
        # port), so the samples are added one by one.
        status = Metric(
            "dynprof_healthcheck_check_status",
            "Status of each check: 0 pass, 1 warn, 2 fail, 3 unknown, -1 skipped.",
            "gauge",
        )
        order = {Status.SKIPPED: 0, Status.PASS: 1, Status.WARN: 2, Status.UNKNOWN: 3, Status.FAIL: 4}
        chosen: dict[tuple[str, str, tuple[tuple[str, str], ...]], Status] = {}
        for c in report.checks:
            device = "node" if c.device is None else str(c.device)
            extra: tuple[tuple[str, str], ...] = ()
            if c.name == "disk_free" and "path" in c.details:
                extra = (("path", str(c.details["path"])),)
            elif c.name == "ib_ports" and "device" in c.details:
                extra = (("port", f"{c.details['device']}/{c.details['port']}"),)
            key = (c.name, device, extra)
            if key not in chosen or order[c.status] > order[chosen[key]]:
                chosen[key] = c.status
        for (name, device, extra), st in chosen.items():
            status.add_sample(
                "dynprof_healthcheck_check_status",
                {"host": host, "check": name, "device": device, **dict(extra)},
                STATUS_CODES[st],
            )
        yield status
        measured = [c for c in report.checks if c.metric and isinstance(c.value, (int, float))]
        if measured:
            family = Metric(
                "dynprof_healthcheck_measurement", "Functional measurement (unit in the metric name).", "gauge"
            )
            for c in measured:
                device = "node" if c.device is None else str(c.device)
                family.add_sample(
                    "dynprof_healthcheck_measurement",
                    {"host": host, "metric": str(c.metric), "device": device},
                    float(f"{float(c.value or 0):.6g}"),
                )
            yield family


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` so that a reader (node_exporter) never sees a half-written file.

    A path that exists and is not a regular file (``/dev/stdout``, ``/dev/null``, a FIFO) is
    written in place: renaming over it would replace a device node when run as root.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        with open(path, "w") as out:
            out.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
