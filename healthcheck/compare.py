"""Judging measurements: against the SKU's baseline and against the device's peers on the node.

* Baseline: below ``fail_below`` (default 90 %) of the baseline median fails, below
  ``warn_below`` (95 %) warns.
* Peers: a device slower than the median of the *other* devices of the same SKU on the node
  by ``peer_fail`` (default 8 %) fails, by ``peer_warn`` (5 %) warns, so a device 10 % slower
  than its peers is caught even without a baseline.
* A wrong result (GEMM mismatch, pattern errors, wrong all-reduce sum) always fails.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from healthcheck.baseline import Baseline
from healthcheck.functional.measurement import Measurement
from healthcheck.result import CheckResult, Status


@dataclass
class Thresholds:
    fail_below: float = 0.90
    warn_below: float = 0.95
    peer_fail: float = 0.08
    peer_warn: float = 0.05


@dataclass
class DeviceMeasurement:
    """One measurement of one device (``device`` None: of the node, e.g. the all-reduce)."""

    device: int | None
    sku: str
    measurement: Measurement
    attempts: list[float] = field(default_factory=list)
    duration_s: float | None = None


def _peer_median(item: DeviceMeasurement, items: list[DeviceMeasurement]) -> tuple[float | None, int]:
    m = item.measurement
    peers = [
        o.measurement.value
        for o in items
        if o is not item
        and o.device is not None
        and o.sku == item.sku
        and o.measurement.metric == m.metric
        and o.measurement.ok
    ]
    return (statistics.median(peers) if peers else None), len(peers)


def judge(
    items: list[DeviceMeasurement],
    baselines: dict[str, Baseline | None],
    thresholds: Thresholds,
) -> list[CheckResult]:
    """One :class:`CheckResult` per measurement; ``baselines`` maps a SKU to its baseline."""
    results = []
    for item in items:
        m = item.measurement
        details = dict(m.details)
        details["correct"] = m.ok
        if len(item.attempts) > 1:
            details["attempts"] = [round(a, 3) for a in item.attempts]
        result = CheckResult(
            m.check,
            Status.PASS,
            "",
            device=item.device,
            value=round(m.value, 3),
            unit=m.unit,
            metric=m.metric,
            duration_s=item.duration_s,
            details=details,
        )
        results.append(result)
        if not m.ok:
            result.status, result.reason, result.action = Status.FAIL, m.reason or "wrong results", "drain"
            continue
        if m.metric is None:  # pass/fail measurements such as the pattern test
            result.reason = "no errors"
            continue
        reasons: list[str] = []
        statuses = [Status.PASS]
        baseline = baselines.get(item.sku)
        reference = baseline.metrics.get(m.metric) if baseline else None
        if reference is not None and reference.median > 0:
            ratio = m.value / reference.median
            details["baseline_median"] = reference.median
            details["baseline_ratio"] = round(ratio, 4)
            result.expected = f">= {thresholds.fail_below * reference.median:.1f} {m.unit}"
            if ratio < thresholds.fail_below:
                statuses.append(Status.FAIL)
                reasons.append(f"{ratio:.0%} of the {item.sku} baseline ({reference.median:g} {m.unit})")
            elif ratio < thresholds.warn_below:
                statuses.append(Status.WARN)
                reasons.append(f"{ratio:.0%} of the {item.sku} baseline ({reference.median:g} {m.unit})")
            else:
                reasons.append(f"{ratio:.0%} of baseline")
        elif m.metric is not None:
            reasons.append(f"no {item.sku} baseline for {m.metric}")
        peer_median, peers = _peer_median(item, items) if item.device is not None else (None, 0)
        if peer_median:
            slower = 1 - m.value / peer_median
            details["peer_median"] = round(peer_median, 3)
            details["peers"] = peers
            if slower >= thresholds.peer_fail:
                statuses.append(Status.FAIL)
                reasons.append(f"{slower:.0%} slower than its {peers} peers ({peer_median:.1f} {m.unit})")
            elif slower >= thresholds.peer_warn:
                statuses.append(Status.WARN)
                reasons.append(f"{slower:.0%} slower than its {peers} peers ({peer_median:.1f} {m.unit})")
            else:
                reasons.append(f"within {max(slower, 0):.0%} of {peers} peers")
        result.status = max(statuses, key=[Status.PASS, Status.WARN, Status.FAIL].index)
        if result.status is Status.FAIL:
            result.action = "drain"
        result.reason = "; ".join(reasons)
    return results


def needs_retry(result: CheckResult) -> bool:
    """A slow (not wrong) measurement fails only if it fails again once repeated."""
    return result.status is Status.FAIL and result.metric is not None and result.details.get("correct") is True
