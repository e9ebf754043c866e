"""InfiniBand / RoCE port error counters, judged on how much they moved during the check.

The kernel shows each port's PMA counters under
``/sys/class/infiniband/DEVICE/ports/PORT/counters/`` (some drivers put them, or more, under
``hw_counters/``). They are totals since the counters were last cleared, and the narrow ones
saturate (``link_downed`` stops at 255), so a total says little: the check reads them at the
start and at the end of the healthcheck and judges the difference. A saturated counter cannot
show a difference and is ``unknown`` (clear it: ``perfquery -x``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from healthcheck.result import CheckResult, Status

IB_ROOT = "/sys/class/infiniband"
NAME = "ib_counters"

# Counters whose increase during the check fails the node (the link is losing symbols or
# retraining), and their PMA widths' maxima (where they saturate).
FAIL_COUNTERS: dict[str, int] = {
    "link_downed": 0xFF,
    "link_error_recovery": 0xFF,
    "symbol_error": 0xFFFF,
    "local_link_integrity_errors": 0xF,
    "port_rcv_errors": 0xFFFF,
    "port_rcv_remote_physical_errors": 0xFFFF,
}
# Counters that also move under congestion: an increase warns.
WARN_COUNTERS: dict[str, int] = {
    "port_xmit_discards": 0xFFFF,
    "excessive_buffer_overrun_errors": 0xF,
}
COUNTERS = {**FAIL_COUNTERS, **WARN_COUNTERS}
_MAX_READ = 64


@dataclass
class IbPortCounters:
    device: str
    port: str
    values: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.device}/{self.port}"


def _read_counter(port: Path, name: str) -> tuple[int | None, str | None]:
    """A counter's value from ``counters/`` or ``hw_counters/``: (value, None), (None, error),
    or (None, None) when the port has no such counter."""
    for folder in ("counters", "hw_counters"):
        path = port / folder / name
        try:
            with open(path, "rb") as fh:
                text = fh.read(_MAX_READ).decode("ascii", errors="replace").strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return None, f"{folder}/{name}: {exc.strerror or exc}"
        try:
            value = int(text, 0)
        except ValueError:
            return None, f"{folder}/{name}: not a number ({text[:20]!r})"
        if value < 0:
            return None, f"{folder}/{name}: negative ({value})"
        return value, None
    return None, None


def read_ib_counters(root: str | Path = IB_ROOT) -> dict[str, IbPortCounters]:
    """Every port's error counters, by ``DEVICE/PORT``; ``{}`` without InfiniBand / RoCE devices."""
    base = Path(root)
    ports: dict[str, IbPortCounters] = {}
    if not base.is_dir():
        return ports
    for dev in sorted(base.iterdir())[:256]:
        for port in sorted((dev / "ports").glob("*"))[:64]:
            reading = IbPortCounters(dev.name, port.name)
            for name in COUNTERS:
                value, error = _read_counter(port, name)
                if value is not None:
                    reading.values[name] = value
                elif error is not None:
                    reading.errors[name] = error
            ports[reading.label] = reading
    return ports


def _port_result(start: IbPortCounters, end: IbPortCounters | None, window_s: float) -> CheckResult:
    label = start.label
    details: dict[str, object] = {"device": start.device, "port": start.port, "window_s": round(window_s, 3)}
    if not start.values:
        if start.errors:
            return CheckResult(
                NAME,
                Status.UNKNOWN,
                f"{label}: error counters not readable ({'; '.join(sorted(start.errors.values())[:3])})",
                details=details,
            )
        return CheckResult(
            NAME,
            Status.SKIPPED,
            f"{label}: the port exposes no error counters (counters/, hw_counters/)",
            details=details,
        )
    if end is None:
        return CheckResult(NAME, Status.UNKNOWN, f"{label}: the port is gone at the end of the check", details=details)
    deltas = {k: end.values[k] - v for k, v in start.values.items() if k in end.values}
    details.update({"start": start.values, "end": end.values, "deltas": deltas})
    lost = sorted(set(start.values) - set(end.values))
    rising_fail = {k: d for k, d in deltas.items() if d > 0 and k in FAIL_COUNTERS}
    rising_warn = {k: d for k, d in deltas.items() if d > 0 and k in WARN_COUNTERS}
    backwards = sorted(k for k, d in deltas.items() if d < 0)
    saturated = sorted(k for k, v in end.values.items() if v >= COUNTERS[k] and k not in rising_fail)

    def named(counters: dict[str, int]) -> str:
        return ", ".join(f"{k} +{d}" for k, d in counters.items())

    if rising_fail:
        return CheckResult(
            NAME,
            Status.FAIL,
            f"{label}: {named(rising_fail)} in {window_s:.1f} s (link losing symbols or retraining: cable, "
            "transceiver or switch port)",
            value=sum(rising_fail.values()),
            expected="0",
            action="drain",
            details=details,
        )
    if lost or backwards:
        return CheckResult(
            NAME,
            Status.UNKNOWN,
            f"{label}: counters {lost + backwards} not readable at the end or went backwards (cleared during the check?)",
            details=details,
        )
    if saturated:
        return CheckResult(
            NAME,
            Status.UNKNOWN,
            f"{label}: {', '.join(saturated)} saturated: an increase cannot be seen; clear the counters (perfquery -x)",
            value=",".join(saturated),
            details=details,
        )
    if rising_warn:
        return CheckResult(
            NAME,
            Status.WARN,
            f"{label}: {named(rising_warn)} in {window_s:.1f} s (congestion or a slow receiver)",
            value=sum(rising_warn.values()),
            expected="0",
            details=details,
        )
    partial = f"; not readable: {', '.join(sorted(start.errors))}" if start.errors else ""
    return CheckResult(
        NAME,
        Status.PASS if not start.errors else Status.UNKNOWN,
        f"{label}: no error counter moved in {window_s:.1f} s ({len(deltas)} counters){partial}",
        value=0,
        expected="0",
        details=details,
    )


def check_ib_counters(
    start: dict[str, IbPortCounters] | None,
    end: dict[str, IbPortCounters] | None,
    window_s: float,
    error: str | None = None,
) -> list[CheckResult]:
    """One result per port. ``start``/``end`` are None when that reading did not return
    (``error`` says why)."""
    if start is None:
        return [CheckResult(NAME, Status.UNKNOWN, f"reading the port counters: {error or 'not taken'}")]
    if not start:
        return [CheckResult(NAME, Status.SKIPPED, "no InfiniBand / RoCE device on this node")]
    if end is None:
        return [
            CheckResult(
                NAME,
                Status.UNKNOWN,
                f"{label}: reading the port counters again at the end: {error or 'not taken'}",
                details={"device": p.device, "port": p.port},
            )
            for label, p in start.items()
        ]
    return [_port_result(p, end.get(label), window_s) for label, p in start.items()]
