"""Deeper device checks: the driver's recovery action, and error counters that move during the check.

A counter's total says what happened since the driver loaded (or the device was last reset);
what matters before a job is whether it is still moving. Each counter is read twice: with the
device's readings at the start of the check and again at its end (after the functional checks
at ``standard``/``full``, so the window then covers the devices under load), and judged on the
difference. The readings at the end are ``end``; a device whose end reading is missing (its
read did not return) is ``unknown``, never ``pass``.

Each check is a decision table (:func:`healthcheck.result.decide`).
"""

from __future__ import annotations

from healthcheck.readings import NVLINK_COUNTERS, DeviceReadings
from healthcheck.result import OTHERWISE, CheckResult, Status, decide, row

# NVML_GPU_RECOVERY_ACTION_* -> (what it means, the action dynprof asks for; None: nothing to do).
RECOVERY_ACTIONS: dict[int, tuple[str, str | None]] = {
    0: ("none", None),
    1: ("GPU reset", "reset"),
    2: ("node reboot", "drain"),
    3: ("drain peer-to-peer traffic", "drain"),
    4: ("drain and reset", "drain"),
    5: ("recover the IMEX domain", "drain"),
    6: ("PCIe bus reset", "reset"),
    7: ("system reboot", "drain"),
}

_SEVERITY = {None: 0, "reset": 1, "drain": 2}


def _missing(r: DeviceReadings, name: str, fields: list[str], source: str) -> CheckResult | None:
    """The result when none of ``fields`` was read (skipped, or unknown with the reason)."""
    if any(getattr(r, f) is not None for f in fields):
        return None
    if all(f in r.not_exposed for f in fields):
        return CheckResult(name, Status.SKIPPED, f"not exposed by {source.removeprefix('smi:')}", device=r.index)
    if all(f in r.not_supported or f in r.not_exposed for f in fields):
        return CheckResult(name, Status.SKIPPED, "not supported by this device or driver", device=r.index)
    errors = sorted({r.errors[f] for f in fields if f in r.errors})
    reason = "; ".join(errors) if errors else f"not available through {source}"
    return CheckResult(name, Status.UNKNOWN, f"could not read {' or '.join(fields)}: {reason}", device=r.index)


def _end_missing(r: DeviceReadings, end: DeviceReadings | None, name: str, why: str | None) -> CheckResult | None:
    if end is not None:
        return None
    return CheckResult(
        name, Status.UNKNOWN, f"the reading at the end of the check is missing: {why or 'not taken'}", device=r.index
    )


def check_recovery_action(
    r: DeviceReadings, source: str, end: DeviceReadings | None = None, end_error: str | None = None
) -> CheckResult:
    """The driver's GPU recovery action (or, where the driver has none, the older reset status
    fields): any action other than "none" fails, read at the start and at the end of the check."""
    name = "recovery_action"
    fields = ["recovery_action", "reset_required", "drain_and_reset_recommended"]
    missing = _missing(r, name, fields, source)
    if missing:
        return missing
    if end is not None and all(getattr(end, f) is None for f in fields):
        # Taken, but without these fields: as good as not taken.
        end_error = "; ".join(sorted({end.errors[f] for f in fields if f in end.errors})) or "fields not read"
        end = None
    readings = [r] if end is None else [r, end]
    if r.recovery_action is not None:
        actions = [x.recovery_action for x in readings if x.recovery_action is not None]
        worst = max(actions, key=lambda a: (_SEVERITY[RECOVERY_ACTIONS.get(a, ("", "drain"))[1]], a))
        meaning, action = RECOVERY_ACTIONS.get(worst, (f"action {worst}, not known to dynprof", "drain"))
        return decide(
            name,
            [
                row(
                    action is not None,
                    Status.FAIL,
                    f"the driver asks for recovery: {meaning} (NVML recovery action {worst})",
                    action=action,
                ),
                row(
                    end is None,
                    Status.UNKNOWN,
                    f"none at the start; the reading at the end of the check is missing: {end_error or 'not taken'}",
                ),
                row(OTHERWISE, Status.PASS, "the driver asks for no recovery action"),
            ],
            value=meaning,
            expected="none",
            details={"recovery_action": worst, "readings": actions, "field": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"},
            device=r.index,
        )
    reset = any(bool(x.reset_required) for x in readings)
    drain = any(bool(x.drain_and_reset_recommended) for x in readings)
    return decide(
        name,
        [
            row(drain, Status.FAIL, "the driver recommends drain and reset", value="drain and reset", action="drain"),
            row(reset, Status.FAIL, "the driver says the GPU needs a reset", value="reset required", action="reset"),
            row(
                end is None,
                Status.UNKNOWN,
                f"no reset needed at the start; the reading at the end of the check is missing: "
                f"{end_error or 'not taken'}",
            ),
            row(OTHERWISE, Status.PASS, "no reset required"),
        ],
        value="none",
        expected="none",
        details={
            "reset_required": [x.reset_required for x in readings],
            "drain_and_reset_recommended": [x.drain_and_reset_recommended for x in readings],
            "field": "reset status",
        },
        device=r.index,
    )


def check_pcie_replay(
    r: DeviceReadings,
    source: str,
    end: DeviceReadings | None,
    window_s: float,
    end_error: str | None = None,
) -> CheckResult:
    """PCIe replays (retransmitted packets) during the check fail: the link is marginal."""
    name = "pcie_replay"
    missing = _missing(r, name, ["pcie_replay_count"], source)
    if missing:
        return missing
    assert r.pcie_replay_count is not None
    gone = _end_missing(r, end, name, end_error)
    if gone:
        return gone
    assert end is not None
    if end.pcie_replay_count is None:
        return CheckResult(
            name,
            Status.UNKNOWN,
            f"could not read the counter again: {end.errors.get('pcie_replay_count', '?')}",
            device=r.index,
        )
    delta = end.pcie_replay_count - r.pcie_replay_count
    return decide(
        name,
        [
            row(
                delta < 0,
                Status.UNKNOWN,
                "the counter went backwards during the check (device reset?)",
                value=None,
            ),
            row(
                delta > 0,
                Status.FAIL,
                f"{delta} PCIe replays in {window_s:.1f} s: the link retransmits (riser, retimer or slot fault)",
                action="drain",
            ),
            row(
                OTHERWISE,
                Status.PASS,
                f"no replay in {window_s:.1f} s ({r.pcie_replay_count} since the driver loaded)",
            ),
        ],
        value=delta,
        expected="0",
        details={"start": r.pcie_replay_count, "end": end.pcie_replay_count, "window_s": round(window_s, 3)},
        device=r.index,
    )


def check_nvlink_errors(
    r: DeviceReadings,
    source: str,
    end: DeviceReadings | None,
    window_s: float,
    end_error: str | None = None,
) -> CheckResult:
    """NVLink replay, recovery and CRC errors that increase during the check fail (reset)."""
    name = "nvlink_errors"
    if "nvlinks" in r.not_supported:
        return CheckResult(name, Status.SKIPPED, "no NVLink on this device", device=r.index)
    if "nvlink_counters" in r.not_exposed:
        return CheckResult(name, Status.SKIPPED, f"not exposed by {source.removeprefix('smi:')}", device=r.index)
    if r.nvlinks is None:
        reason = r.errors.get("nvlinks") or f"not available through {source}"
        return CheckResult(name, Status.UNKNOWN, f"could not read the NVLinks: {reason}", device=r.index)
    active = [link for link in r.nvlinks if link.active]
    if not active:
        return CheckResult(name, Status.SKIPPED, "no NVLink is active (see nvlink)", device=r.index)
    unread = [link.link for link in active if not link.counters()]
    if len(unread) == len(active):
        if "nvlink_counters" in r.not_supported:
            return CheckResult(
                name, Status.SKIPPED, "NVLink error counters not supported by this device or driver", device=r.index
            )
        reason = r.errors.get("nvlink_counters") or f"not available through {source}"
        return CheckResult(name, Status.UNKNOWN, f"could not read the NVLink error counters: {reason}", device=r.index)
    gone = _end_missing(r, end, name, end_error)
    if gone:
        return gone
    assert end is not None
    end_links = {link.link: link for link in end.nvlinks or []}
    rising: list[str] = []
    backwards: list[str] = []
    lost: list[int] = []
    per_link: dict[str, dict[str, int]] = {}
    for link in active:
        before = link.counters()
        if not before:
            continue
        after_link = end_links.get(link.link)
        after = after_link.counters() if after_link is not None else {}
        if not after:
            lost.append(link.link)
            continue
        deltas = {k: after[k] - before[k] for k in before if k in after}
        per_link[str(link.link)] = deltas
        rising += [f"link {link.link} {k.removesuffix('_errors')} +{d}" for k, d in deltas.items() if d > 0]
        backwards += [f"link {link.link} {k}" for k, d in deltas.items() if d < 0]
    totals = {k: sum(link.counters().get(k, 0) for link in active) for k in NVLINK_COUNTERS}
    return decide(
        name,
        [
            row(
                bool(rising),
                Status.FAIL,
                f"NVLink errors during the check ({window_s:.1f} s): {', '.join(rising[:8])}",
                value=len(rising),
                action="reset",
            ),
            row(
                bool(lost) or bool(unread),
                Status.UNKNOWN,
                f"error counters of links {sorted(set(lost + unread))} not read at both ends of the check",
            ),
            row(bool(backwards), Status.UNKNOWN, f"counters went backwards ({', '.join(backwards[:4])}): link reset?"),
            row(
                OTHERWISE,
                Status.PASS,
                f"no NVLink error in {window_s:.1f} s on {len(per_link)} links",
                value=0,
            ),
        ],
        expected="0",
        details={"deltas": per_link, "totals_at_start": totals, "window_s": round(window_s, 3)},
        device=r.index,
    )


def counter_checks(
    r: DeviceReadings, source: str, end: DeviceReadings | None, window_s: float, end_error: str | None = None
) -> list[CheckResult]:
    return [
        check_recovery_action(r, source, end, end_error),
        check_pcie_replay(r, source, end, window_s, end_error),
        check_nvlink_errors(r, source, end, window_s, end_error),
    ]
