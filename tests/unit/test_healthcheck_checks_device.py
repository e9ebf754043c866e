"""Decision logic of the passive device checks, against device readings."""

from __future__ import annotations

import pytest

from healthcheck.checks.device import (
    check_clocks,
    check_devices,
    check_ecc_errors,
    check_ecc_mode,
    check_nvlink,
    check_pcie_link,
    check_persistence_mode,
    check_processes,
    check_retired_pages,
    check_row_remap,
    check_temperature,
    not_read,
    result,
    verdict,
)
from healthcheck.readings import DeviceProcess, DeviceReadings, NvLinkReading
from healthcheck.result import Status, row


def readings(**fields) -> DeviceReadings:
    return DeviceReadings(index=3, **fields)


# -- ECC --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("volatile", "aggregate", "status", "action"),
    [(0, 0, Status.PASS, None), (0, 2, Status.WARN, None), (1, 1, Status.FAIL, "reset"), (4, 0, Status.FAIL, "reset")],
)
def test_uncorrectable_ecc_since_reset_fails_lifetime_only_warns(volatile, aggregate, status, action):
    # GIVEN a device's uncorrectable ECC counters
    r = readings(ecc_enabled=True, ecc_uncorrected_volatile=volatile, ecc_uncorrected_aggregate=aggregate)
    # WHEN judged
    result = check_ecc_errors(r, "nvml")
    # THEN volatile errors need a reset; lifetime-only errors warn
    assert (result.status, result.action, result.device) == (status, action, 3)


def test_ecc_off_fails_and_counters_are_not_judged():
    r = readings(ecc_enabled=False, ecc_pending_enabled=False)
    assert check_ecc_mode(r, "nvml").status is Status.FAIL
    assert check_ecc_mode(r, "nvml").action == "drain"
    assert check_ecc_errors(r, "nvml").status is Status.SKIPPED


def test_ecc_on_but_off_after_reset_warns():
    assert check_ecc_mode(readings(ecc_enabled=True, ecc_pending_enabled=False), "nvml").status is Status.WARN


def test_unreadable_counter_is_unknown_with_the_error_never_pass():
    # GIVEN an NVML error on the volatile counter
    r = readings(
        ecc_enabled=True, ecc_uncorrected_aggregate=0, errors={"ecc_uncorrected_volatile": "NVML: Unknown Error"}
    )
    # WHEN judged
    result = check_ecc_errors(r, "nvml")
    # THEN the check is unknown and says why
    assert result.status is Status.UNKNOWN
    assert "NVML: Unknown Error" in result.reason


def test_field_an_smi_tool_cannot_give_is_not_available():
    result = check_ecc_errors(readings(ecc_enabled=True), "smi:ppu-smi")
    assert result.status is Status.UNKNOWN
    assert "not available through smi:ppu-smi" in result.reason


def test_not_supported_feature_is_skipped():
    r = readings(not_supported={"ecc_enabled"})
    assert check_ecc_mode(r, "nvml").status is Status.SKIPPED
    assert not_read(r, "x", ["ecc_enabled"], "nvml").status is Status.SKIPPED


# -- row remapping and retired pages ---------------------------------------------------------
@pytest.mark.parametrize(
    ("pending", "failure", "exhausted", "status", "action"),
    [
        (False, False, 0, Status.PASS, None),
        (True, False, 0, Status.FAIL, "reset"),
        (False, True, 0, Status.FAIL, "drain"),
        (True, True, 0, Status.FAIL, "drain"),
        (False, False, 2, Status.WARN, None),
    ],
)
def test_row_remap_pending_needs_reset_failure_needs_replacement(pending, failure, exhausted, status, action):
    r = readings(
        remapped_rows_correctable=1,
        remapped_rows_uncorrectable=2,
        remap_pending=pending,
        remap_failure=failure,
        remap_banks_exhausted=exhausted,
    )
    result = check_row_remap(r, "nvml")
    assert (result.status, result.action) == (status, action)
    assert result.details["uncorrectable_rows"] == 2


def test_retired_pages_judged_only_on_gpus_without_row_remapping():
    assert check_retired_pages(readings(remap_pending=False, remap_failure=False), "nvml").status is Status.SKIPPED
    ok = readings(retired_pages_sbe=3, retired_pages_dbe=1, retired_pages_pending=False)
    assert check_retired_pages(ok, "nvml").status is Status.PASS
    pending = readings(retired_pages_sbe=3, retired_pages_dbe=1, retired_pages_pending=True)
    assert check_retired_pages(pending, "nvml").action == "reset"
    worn = readings(retired_pages_sbe=40, retired_pages_dbe=20, retired_pages_pending=False)
    assert check_retired_pages(worn, "nvml").status is Status.FAIL
    assert check_retired_pages(worn, "nvml").action == "drain"


# -- PCIe ----------------------------------------------------------------------------------------
def link(gen: int, width: int) -> DeviceReadings:
    return readings(pcie_gen_current=gen, pcie_width_current=width, pcie_gen_max=5, pcie_width_max=16)


def test_pcie_idle_downshift_is_not_a_failure_but_is_unknown_until_loaded():
    # GIVEN an H200 idling at Gen1 (power saving), which trains to Gen5 x16 under load
    r = link(1, 16)
    # WHEN judged without and with a reading under load
    idle = check_pcie_link(r, "nvml", load_error="torch is not importable here")
    loaded = check_pcie_link(r, "nvml", loaded_gen=5, loaded_width=16)
    # THEN idle alone proves nothing; under load it passes
    assert idle.status is Status.UNKNOWN and "torch is not importable" in idle.reason
    assert loaded.status is Status.PASS and loaded.value == "Gen5 x16"


@pytest.mark.parametrize(("gen", "width", "what"), [(4, 16, "generation"), (5, 8, "lanes"), (3, 4, "lanes")])
def test_pcie_below_maximum_under_load_fails(gen, width, what):
    result = check_pcie_link(link(1, 16), "nvml", loaded_gen=gen, loaded_width=width)
    assert result.status is Status.FAIL and result.action == "drain"
    assert what in result.reason
    assert result.expected == "Gen5 x16"


def test_pcie_at_maximum_while_idle_passes_without_load():
    assert check_pcie_link(link(5, 16), "nvml").status is Status.PASS


# -- clocks and temperature ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mask", "status"),
    [
        (0x0, Status.PASS),
        (0x1, Status.PASS),  # idle
        (0x4, Status.PASS),  # software power cap: normal under load
        (0x20, Status.WARN),  # software thermal slowdown
        (0x8, Status.FAIL),  # hardware slowdown
        (0x40, Status.FAIL),  # hardware thermal slowdown
        (0x80 | 0x4, Status.FAIL),  # hardware power brake
    ],
)
def test_clock_event_reasons(mask, status):
    result = check_clocks(readings(clock_event_reasons=mask, sm_clock_mhz=1980), "nvml")
    assert result.status is status
    assert result.details["mask"] == hex(mask)


def test_clock_reasons_are_named():
    result = check_clocks(readings(clock_event_reasons=0x48), "nvml")
    assert "hw_slowdown" in result.reason and "hw_thermal_slowdown" in result.reason


@pytest.mark.parametrize(("temp", "status"), [(40, Status.PASS), (83, Status.WARN), (87, Status.FAIL)])
def test_temperature_against_the_device_slowdown_threshold(temp, status):
    assert check_temperature(readings(temperature_c=temp, temperature_slowdown_c=87), "nvml").status is status


def test_temperature_without_a_threshold_uses_the_default_and_says_so():
    result = check_temperature(readings(temperature_c=50), "smi:ppu-smi")
    assert result.status is Status.PASS and "default limit" in result.reason


# -- NVLink, persistence, processes --------------------------------------------------------------
def links(active: int, total: int = 18, recovery: int = 0) -> list[NvLinkReading]:
    return [NvLinkReading(i, i < active, 0, recovery if i == 0 else 0, 0, 0) for i in range(total)]


def test_nvlink_fewer_active_links_than_peers_fails():
    assert check_nvlink(readings(nvlinks=links(18)), "nvml", peer_active=18).status is Status.PASS
    down = check_nvlink(readings(nvlinks=links(16)), "nvml", peer_active=18)
    assert down.status is Status.FAIL and "links [16, 17] down" in down.reason
    assert check_nvlink(readings(nvlinks=links(18, recovery=3)), "nvml", 18).status is Status.WARN
    assert check_nvlink(readings(nvlinks=links(0)), "nvml").status is Status.WARN
    assert check_nvlink(readings(nvlinks=[], not_supported={"nvlinks"}), "nvml").status is Status.SKIPPED


def test_persistence_mode_off_warns():
    assert check_persistence_mode(readings(persistence_mode=False), "nvml").status is Status.WARN
    assert check_persistence_mode(readings(persistence_mode=True), "nvml").status is Status.PASS


def test_other_processes_on_the_device_warn_but_our_own_do_not():
    procs = [DeviceProcess(100, 2 * 1024**3), DeviceProcess(200, 1024**3)]
    result = check_processes(readings(processes=procs), "nvml", own_pids=frozenset({200}))
    assert result.status is Status.WARN and result.value == 1 and "100" in result.reason
    assert check_processes(readings(processes=procs[1:]), "nvml", frozenset({200})).status is Status.PASS


# -- the decision table -----------------------------------------------------------------------
def test_the_first_row_that_holds_decides():
    # GIVEN a table whose second and third rows both hold
    rows = [
        row(False, Status.FAIL, "never"),
        row(True, Status.WARN, "second"),
        row(True, Status.PASS, "third"),
    ]
    # WHEN judged
    got = verdict(readings(), "some_check", rows)
    # THEN the second row's verdict is given, on the device read
    assert (got.name, got.status, got.reason, got.device) == ("some_check", Status.WARN, "second", 3)


def test_a_rows_own_fields_replace_the_shared_ones_and_none_drops_one():
    rows = [row(True, Status.FAIL, "bad", value=9, expected=None, action="drain")]
    got = verdict(readings(), "c", rows, value=1, expected=">= 2", unit="W")
    assert (got.value, got.expected, got.unit, got.action) == (9, None, "W", "drain")


def test_a_table_where_no_row_holds_is_a_programming_error():
    with pytest.raises(AssertionError, match="no row of the decision table holds"):
        verdict(readings(), "broken_check", [row(False, Status.PASS, "x")])


def test_result_is_about_the_device_read():
    got = result(readings(), "c", Status.PASS, "ok", value=1)
    assert (got.device, got.value) == (3, 1)


def test_not_read_is_none_when_every_field_is_there():
    assert not_read(readings(temperature_c=40), "temperature", ["temperature_c"], "nvml") is None


def test_not_read_names_every_missing_field_and_each_error_once():
    r = readings(errors={"temperature_c": "NVML: Unknown Error", "sm_clock_mhz": "NVML: Unknown Error"})
    got = not_read(r, "c", ["temperature_c", "sm_clock_mhz"], "nvml")
    assert got.status is Status.UNKNOWN
    assert got.reason == "could not read temperature_c, sm_clock_mhz: NVML: Unknown Error"


# -- the devices the backend lists ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("count", "expected", "status", "said"),
    [
        (8, None, Status.PASS, "8 found through nvml (no expected count"),
        (0, None, Status.UNKNOWN, "nvml lists no device"),
        (8, 8, Status.PASS, "8 found, 8 expected (SLURM_GPUS_ON_NODE)"),
        (6, 8, Status.FAIL, "2 devices missing (SLURM_GPUS_ON_NODE expects 8): fallen off the bus"),
        (9, 8, Status.WARN, "more devices than expected (SLURM_GPUS_ON_NODE)"),
    ],
)
def test_the_devices_listed_are_judged_against_those_expected(count, expected, status, said):
    got = check_devices(count, expected, "SLURM_GPUS_ON_NODE", "nvml")
    assert (got.name, got.status, got.critical, got.value) == ("devices", status, True, count)
    assert got.reason.startswith(said)
    assert got.expected == (None if expected is None and count else ">= 1" if expected is None else str(expected))
    assert got.action == ("drain" if status is Status.FAIL else None)
    assert ("help" in got.details) == (status is Status.UNKNOWN)
