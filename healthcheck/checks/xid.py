"""XID checks: errors in the kernel log within a window, and XID events seen during the run."""

from __future__ import annotations

from collections.abc import Sequence

from healthcheck.backends.base import XidEvent
from healthcheck.result import CheckResult, Status
from healthcheck.xid import ACTION_ORDER, DRAIN, RESET, WARN, XidRecord, policy_for


def _judge(name: str, device: int | None, xids: list[tuple[int, str]], where: str) -> CheckResult:
    """One result for the XIDs ``(xid, message)`` seen on one device."""
    if not xids:
        return CheckResult(name, Status.PASS, f"no XID {where}", device=device, value=0)
    policies = [(xid, policy_for(xid, message)) for xid, message in xids]
    worst = max((p.action for _, p in policies), key=lambda a: ACTION_ORDER[a])
    seen = sorted({xid for xid, _ in xids})
    named = "; ".join(
        f"XID {xid} {p.meaning} -> {p.action} ({p.why})" for xid, p in {x: p for x, p in policies}.items()
    )
    details = {
        "xids": [
            {"xid": xid, "action": p.action, "message": message}
            for (xid, message), (_, p) in zip(xids, policies, strict=False)
        ][:50]
    }
    status = Status.FAIL if worst in (DRAIN, RESET) else Status.WARN
    return CheckResult(
        name,
        status,
        f"{len(xids)} XID {where}: {named}",
        device=device,
        value=",".join(str(x) for x in seen),
        expected="none",
        action=worst if worst != WARN else None,
        details=details,
    )


def check_kernel_log_xids(
    records: Sequence[XidRecord], devices: dict[str, int], window_s: float, source: str
) -> list[CheckResult]:
    """Judge the XID lines of the kernel log: one result per device (by PCI bus id).

    ``devices`` maps normalized bus ids (``0000:3b:00``) to device indices; an XID of a bus
    that is not one of them (a device this container was not given) is reported on the node.
    """
    name = "xid_kernel_log"
    window = f"in the kernel log ({source}) in the last {window_s / 60:.0f} min"
    by_device: dict[int | None, list[tuple[int, str]]] = {index: [] for index in devices.values()}
    for record in records:
        index = devices.get(record.bus_id or "")
        by_device.setdefault(index, []).append((record.xid, record.message))
    results = []
    for index, xids in sorted(by_device.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        result = _judge(name, index, xids, window)
        if index is None and xids:
            result.reason += " (on a PCI device not checked here)"
            if result.status is Status.FAIL:
                result.status = Status.WARN
        results.append(result)
    if not results:
        results.append(CheckResult(name, Status.PASS, f"no XID {window}", value=0))
    return results


def check_live_xids(events: Sequence[XidEvent], watching: bool, device_indices: Sequence[int]) -> list[CheckResult]:
    name = "xid_live"
    if not watching:
        return [CheckResult(name, Status.UNKNOWN, "this backend cannot listen for XID events")]
    by_device: dict[int | None, list[tuple[int, str]]] = {index: [] for index in device_indices}
    for event in events:
        by_device.setdefault(event.device, []).append((event.xid, ""))
    return [
        _judge(name, index, xids, "during the healthcheck")
        for index, xids in sorted(by_device.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
    ]


__all__ = ["DRAIN", "RESET", "check_kernel_log_xids", "check_live_xids"]
