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
    from dynprof.output import table

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


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def render_prometheus(report: Report) -> str:
    """Prometheus text exposition format, for node_exporter's textfile collector."""
    host = _label(report.host)
    level = _label(report.level)
    lines = [
        "# HELP dynprof_healthcheck_exit_code Exit code of the last healthcheck: 0 healthy, 1 warning, "
        "2 unhealthy, 3 could not run.",
        "# TYPE dynprof_healthcheck_exit_code gauge",
        f'dynprof_healthcheck_exit_code{{host="{host}",level="{level}"}} {report.exit_code}',
        "# HELP dynprof_healthcheck_duration_seconds Wall time of the last healthcheck.",
        "# TYPE dynprof_healthcheck_duration_seconds gauge",
        f'dynprof_healthcheck_duration_seconds{{host="{host}",level="{level}"}} {report.duration_s:.3f}',
        "# HELP dynprof_healthcheck_check_status Status of each check: 0 pass, 1 warn, 2 fail, 3 unknown, -1 skipped.",
        "# TYPE dynprof_healthcheck_check_status gauge",
    ]
    # One series per check and device (and path or port); where a check has several results
    # for the same labels, the worst status is exported.
    worst: dict[tuple[str, str, str], int] = {}
    rank = {Status.SKIPPED: 0, Status.PASS: 1, Status.WARN: 2, Status.UNKNOWN: 3, Status.FAIL: 4}
    chosen: dict[tuple[str, str, str], Status] = {}
    for c in report.checks:
        device = "node" if c.device is None else str(c.device)
        extra = ""
        if c.name == "disk_free" and "path" in c.details:
            extra = f',path="{_label(c.details["path"])}"'
        elif c.name == "ib_ports" and "device" in c.details:
            extra = f',port="{_label(c.details["device"])}/{_label(c.details["port"])}"'
        key = (c.name, device, extra)
        if key not in chosen or rank[c.status] > rank[chosen[key]]:
            chosen[key] = c.status
            worst[key] = STATUS_CODES[c.status]
    for (name, device, extra), code in worst.items():
        lines.append(
            f'dynprof_healthcheck_check_status{{host="{host}",check="{_label(name)}",device="{device}"{extra}}} {code}'
        )
    measured = [c for c in report.checks if c.metric and isinstance(c.value, (int, float))]
    if measured:
        lines += [
            "# HELP dynprof_healthcheck_measurement Functional measurement (unit in the metric name).",
            "# TYPE dynprof_healthcheck_measurement gauge",
        ]
        for c in measured:
            device = "node" if c.device is None else str(c.device)
            lines.append(
                f'dynprof_healthcheck_measurement{{host="{host}",metric="{_label(c.metric)}",'
                f'device="{device}"}} {float(c.value or 0):.6g}'
            )
    return "\n".join(lines) + "\n"


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
