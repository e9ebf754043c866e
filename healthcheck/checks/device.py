"""Passive checks of one accelerator, judged from its :class:`DeviceReadings`.

Each check reads what it needs, then says its verdict as a decision table
(:func:`healthcheck.result.decide`, on the device read: :func:`verdict`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from healthcheck.backends.base import NoAccelerator
from healthcheck.readings import (
    CLOCK_HW_POWER_BRAKE,
    CLOCK_HW_SLOWDOWN,
    CLOCK_HW_THERMAL,
    CLOCK_SW_THERMAL,
    DeviceReadings,
    clock_reason_names,
)
from healthcheck.result import OTHERWISE, CheckResult, Row, Status, decide, row

# Used when the device does not report its own slowdown threshold.
DEFAULT_SLOWDOWN_C = 87
TEMPERATURE_MARGIN_C = 5
# NVIDIA's guidance: a GPU with 60 or more retired pages should be replaced.
RETIRED_PAGES_LIMIT = 60


def result(r: DeviceReadings, name: str, status: Status, message: str, **fields: Any) -> CheckResult:
    """A result of check ``name`` on device ``r``."""
    return CheckResult(name, status, message, device=r.index, **fields)


def verdict(r: DeviceReadings, name: str, rows: Sequence[Row], **shared: Any) -> CheckResult:
    """The decision table's result (:func:`healthcheck.result.decide`) on device ``r``."""
    return decide(name, rows, device=r.index, **shared)


def not_read(r: DeviceReadings, name: str, fields: Iterable[str], source: str) -> CheckResult | None:
    """The result for a check whose readings are missing, or None if they are all there."""
    missing = [f for f in fields if getattr(r, f) is None]
    if not missing:
        return None
    if all(f in r.not_supported for f in missing):
        return result(r, name, Status.SKIPPED, "not supported by this device")
    errors = sorted({r.errors[f] for f in missing if f in r.errors})
    reason = "; ".join(errors) if errors else f"not available through {source}"
    return result(r, name, Status.UNKNOWN, f"could not read {', '.join(missing)}: {reason}")


def check_persistence_mode(r: DeviceReadings, source: str) -> CheckResult:
    name = "persistence_mode"
    missing = not_read(r, name, ["persistence_mode"], source)
    if missing:
        return missing
    return verdict(
        r,
        name,
        [
            row(bool(r.persistence_mode), Status.PASS, "enabled", value="enabled"),
            row(
                OTHERWISE,
                Status.WARN,
                "disabled: the driver is torn down between jobs (slow start, lost state); run nvidia-persistenced",
                value="disabled",
            ),
        ],
        expected="enabled",
    )


def check_ecc_mode(r: DeviceReadings, source: str) -> CheckResult:
    name = "ecc_mode"
    missing = not_read(r, name, ["ecc_enabled"], source)
    if missing:
        return missing
    return verdict(
        r,
        name,
        [
            row(
                not r.ecc_enabled,
                Status.FAIL,
                "ECC is off: memory corruption would go unnoticed; enable it (nvidia-smi -e 1) and reset",
                value="disabled",
                action="drain",
            ),
            row(
                r.ecc_pending_enabled is False,
                Status.WARN,
                "ECC is on but will be off after the next reset",
                expected=None,
            ),
            row(OTHERWISE, Status.PASS, "enabled"),
        ],
        value="enabled",
        expected="enabled",
    )


def check_ecc_errors(r: DeviceReadings, source: str) -> CheckResult:
    name = "ecc_errors"
    if r.ecc_enabled is False:
        return result(r, name, Status.SKIPPED, "ECC is off (see ecc_mode)")
    missing = not_read(r, name, ["ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"], source)
    if missing:
        return missing
    assert r.ecc_uncorrected_volatile is not None and r.ecc_uncorrected_aggregate is not None
    volatile, aggregate = r.ecc_uncorrected_volatile, r.ecc_uncorrected_aggregate
    return verdict(
        r,
        name,
        [
            row(
                volatile > 0,
                Status.FAIL,
                f"{volatile} uncorrectable ECC errors since the last reset: reset the GPU",
                value=volatile,
                action="reset",
            ),
            row(
                aggregate > 0,
                Status.WARN,
                f"{aggregate} uncorrectable ECC errors in the device's lifetime, none since reset",
                value=aggregate,
            ),
            row(OTHERWISE, Status.PASS, "no uncorrectable ECC errors", value=0, expected=None),
        ],
        expected="0",
        details={
            "uncorrected_volatile": volatile,
            "uncorrected_aggregate": aggregate,
            "corrected_volatile": r.ecc_corrected_volatile,
        },
    )


def check_row_remap(r: DeviceReadings, source: str) -> CheckResult:
    name = "row_remap"
    missing = not_read(r, name, ["remap_pending", "remap_failure"], source)
    if missing:
        return missing
    rows = (r.remapped_rows_correctable or 0) + (r.remapped_rows_uncorrectable or 0)
    return verdict(
        r,
        name,
        [
            row(
                bool(r.remap_failure),
                Status.FAIL,
                "a row remapping failed: memory cannot be repaired; replace the GPU",
                value="failure",
                action="drain",
            ),
            row(
                bool(r.remap_pending),
                Status.FAIL,
                "a row remap is pending: reset the GPU to apply it",
                value="pending",
                action="reset",
            ),
            row(
                bool(r.remap_banks_exhausted),
                Status.WARN,
                f"{r.remap_banks_exhausted} memory banks have no spare row left",
                value=r.remap_banks_exhausted,
            ),
            row(OTHERWISE, Status.PASS, f"{rows} rows remapped, none pending", value=rows),
        ],
        details={
            "correctable_rows": r.remapped_rows_correctable,
            "uncorrectable_rows": r.remapped_rows_uncorrectable,
            "pending": r.remap_pending,
            "failure": r.remap_failure,
            "banks_without_spare_rows": r.remap_banks_exhausted,
        },
    )


def check_retired_pages(r: DeviceReadings, source: str) -> CheckResult:
    name = "retired_pages"
    if r.remap_pending is not None or r.remap_failure is not None:
        return result(r, name, Status.SKIPPED, "the device repairs memory by row remapping")
    missing = not_read(r, name, ["retired_pages_pending", "retired_pages_sbe", "retired_pages_dbe"], source)
    if missing:
        return missing
    total = (r.retired_pages_sbe or 0) + (r.retired_pages_dbe or 0)
    return verdict(
        r,
        name,
        [
            row(
                bool(r.retired_pages_pending),
                Status.FAIL,
                "a page retirement is pending: reset the GPU",
                action="reset",
            ),
            row(
                total >= RETIRED_PAGES_LIMIT,
                Status.FAIL,
                f"{total} pages retired (limit {RETIRED_PAGES_LIMIT}): replace the GPU",
                expected=f"< {RETIRED_PAGES_LIMIT}",
                action="drain",
            ),
            row(OTHERWISE, Status.PASS, f"{total} pages retired, none pending"),
        ],
        value=total,
        details={
            "single_bit": r.retired_pages_sbe,
            "double_bit": r.retired_pages_dbe,
            "pending": r.retired_pages_pending,
        },
    )


def check_pcie_link(
    r: DeviceReadings,
    source: str,
    loaded_gen: int | None = None,
    loaded_width: int | None = None,
    load_error: str | None = None,
) -> CheckResult:
    """The PCIe link against the device's maximum, read while the link carries traffic.

    Links drop to a lower generation when idle to save power, so an idle reading below the
    maximum proves nothing: without a reading under load such a link is "unknown".
    """
    name = "pcie_link"
    missing = not_read(r, name, ["pcie_gen_max", "pcie_width_max"], source)
    if missing:
        return missing
    assert r.pcie_gen_max is not None and r.pcie_width_max is not None
    expected = f"Gen{r.pcie_gen_max} x{r.pcie_width_max}"
    loaded = loaded_gen is not None and loaded_width is not None
    gen = loaded_gen if loaded else r.pcie_gen_current
    width = loaded_width if loaded else r.pcie_width_current
    if gen is None or width is None:
        return result(r, name, Status.UNKNOWN, "current link not readable", expected=expected)
    why = f": {load_error}" if load_error else ""
    what = "lanes" if width < r.pcie_width_max else "generation"
    return verdict(
        r,
        name,
        [
            row(
                gen >= r.pcie_gen_max and width >= r.pcie_width_max,
                Status.PASS,
                f"at its maximum ({'under load' if loaded else 'idle'})",
            ),
            row(
                not loaded,
                Status.UNKNOWN,
                f"below the maximum while idle (links downshift when idle); not read under load{why}",
            ),
            row(
                OTHERWISE,
                Status.FAIL,
                f"link trained below its maximum {what} under load (riser, retimer or slot fault)",
                action="drain",
            ),
        ],
        value=f"Gen{gen} x{width}",
        expected=expected,
        details={"idle": f"Gen{r.pcie_gen_current} x{r.pcie_width_current}", "under_load": loaded},
    )


def check_clocks(r: DeviceReadings, source: str, name: str = "clock_events") -> CheckResult:
    """Clock-event reasons: hardware slowdowns fail, software thermal slowdown warns.

    The software power cap is normal under load and reported only.
    """
    missing = not_read(r, name, ["clock_event_reasons"], source)
    if missing:
        return missing
    mask = r.clock_event_reasons or 0
    active = clock_reason_names(mask)
    hw = mask & (CLOCK_HW_SLOWDOWN | CLOCK_HW_THERMAL | CLOCK_HW_POWER_BRAKE)
    return verdict(
        r,
        name,
        [
            row(
                bool(hw),
                Status.FAIL,
                f"hardware slowdown active ({', '.join(clock_reason_names(hw))}): cooling or power fault",
                expected="no hw slowdown",
                action="drain",
            ),
            row(
                bool(mask & CLOCK_SW_THERMAL),
                Status.WARN,
                "software thermal slowdown active: the GPU runs hot",
                expected="no thermal slowdown",
            ),
            row(OTHERWISE, Status.PASS, "no hardware or thermal slowdown"),
        ],
        value=",".join(active) or "none",
        details={
            "reasons": active,
            "mask": hex(mask),
            "sm_clock_mhz": r.sm_clock_mhz,
            "sm_clock_max_mhz": r.sm_clock_max_mhz,
        },
    )


def check_temperature(r: DeviceReadings, source: str) -> CheckResult:
    name = "temperature"
    missing = not_read(r, name, ["temperature_c"], source)
    if missing:
        return missing
    assert r.temperature_c is not None
    limit = r.temperature_slowdown_c or DEFAULT_SLOWDOWN_C
    basis = "slowdown threshold" if r.temperature_slowdown_c else "default limit (device threshold not readable)"
    return verdict(
        r,
        name,
        [
            row(r.temperature_c >= limit, Status.FAIL, f"at or above the {basis} ({limit} C)", action="drain"),
            row(
                r.temperature_c >= limit - TEMPERATURE_MARGIN_C,
                Status.WARN,
                f"within {TEMPERATURE_MARGIN_C} C of the {basis} ({limit} C)",
            ),
            row(OTHERWISE, Status.PASS, f"below the {basis} ({limit} C)"),
        ],
        value=r.temperature_c,
        unit="C",
        expected=f"< {limit - TEMPERATURE_MARGIN_C} C",
        details={"slowdown_c": r.temperature_slowdown_c, "shutdown_c": r.temperature_shutdown_c},
    )


def check_nvlink(r: DeviceReadings, source: str, peer_active: int | None = None) -> CheckResult:
    """NVLink state: fewer active links than the device's same-SKU peers fails; recovery errors warn."""
    name = "nvlink"
    if "nvlinks" in r.not_supported:
        return result(r, name, Status.SKIPPED, "no NVLink on this device")
    missing = not_read(r, name, ["nvlinks"], source)
    if missing:
        return missing
    assert r.nvlinks is not None
    active = sum(1 for link in r.nvlinks if link.active)
    inactive = [link.link for link in r.nvlinks if not link.active]
    recovery = sum(link.recovery_errors or 0 for link in r.nvlinks)
    return verdict(
        r,
        name,
        [
            row(
                active == 0,
                Status.WARN,
                "no NVLink is active (bridge missing, or fabric manager not running)",
            ),
            row(
                peer_active is not None and active < peer_active,
                Status.FAIL,
                f"{active} links active where its peers have {peer_active} (links {inactive} down)",
                expected=f"{peer_active} active",
                action="reset",
            ),
            row(bool(recovery), Status.WARN, f"{recovery} link recovery errors"),
            row(OTHERWISE, Status.PASS, "links up, no recovery errors"),
        ],
        value=f"{active}/{len(r.nvlinks)} active",
        details={
            "links": len(r.nvlinks),
            "active": active,
            "inactive_links": inactive,
            "replay_errors": sum(link.replay_errors or 0 for link in r.nvlinks),
            "recovery_errors": recovery,
            "crc_flit_errors": sum(link.crc_flit_errors or 0 for link in r.nvlinks),
            "crc_data_errors": sum(link.crc_data_errors or 0 for link in r.nvlinks),
        },
    )


def check_processes(r: DeviceReadings, source: str, own_pids: frozenset[int] = frozenset()) -> CheckResult:
    name = "device_processes"
    missing = not_read(r, name, ["processes"], source)
    if missing:
        return missing
    assert r.processes is not None
    others = [p for p in r.processes if p.pid not in own_pids]
    used = sum(p.used_memory_bytes or 0 for p in others)
    pids = ", ".join(str(p.pid) for p in others[:8])
    return verdict(
        r,
        name,
        [
            row(not others, Status.PASS, "no other process holds the device", value=0),
            row(
                OTHERWISE,
                Status.WARN,
                f"{len(others)} other processes hold the device (pids {pids}; {used / 1024**3:.1f} GiB)",
                value=len(others),
                expected="0",
                details={"processes": [{"pid": p.pid, "used_memory_bytes": p.used_memory_bytes} for p in others]},
            ),
        ],
    )


def check_devices(count: int, expected: int | None, source: str, backend: str) -> CheckResult:
    """How many devices ``backend`` lists, against how many this node must have (None: not
    said; ``source`` says who expects them)."""
    missing = (expected or 0) - count
    return decide(
        "devices",
        [
            row(
                expected is None and count > 0,
                Status.PASS,
                f"{count} found through {backend} (no expected count: give --expect-devices or run under Slurm)",
                expected=None,
            ),
            row(
                expected is None,
                Status.UNKNOWN,
                f"{backend} lists no device",
                expected=">= 1",
                details={"help": NoAccelerator.default_help},
            ),
            row(count == expected, Status.PASS, f"{count} found, {expected} expected ({source})"),
            row(
                missing > 0,
                Status.FAIL,
                f"{missing} devices missing ({source} expects {expected}): fallen off the bus or not given to "
                "this container",
                action="drain",
            ),
            row(OTHERWISE, Status.WARN, f"more devices than expected ({source})"),
        ],
        value=count,
        expected=str(expected),
        critical=True,
    )
