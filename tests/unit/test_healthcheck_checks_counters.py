"""healthcheck.checks.counters: the driver's recovery action and the error counters judged on
what they did during the check (start reading vs end reading); a missing end is never a pass."""

from __future__ import annotations

import pytest

from healthcheck.checks.counters import (
    RECOVERY_ACTIONS,
    check_nvlink_errors,
    check_pcie_replay,
    check_recovery_action,
    counter_checks,
)
from healthcheck.readings import DeviceReadings, NvLinkReading
from healthcheck.result import Status


def readings(**fields) -> DeviceReadings:
    return DeviceReadings(index=2, **fields)


# -- recovery action --------------------------------------------------------------------------
@pytest.mark.parametrize(("code", "action"), [(k, v[1]) for k, v in RECOVERY_ACTIONS.items()])
def test_every_recovery_action_but_none_fails_with_its_action(code, action):
    # GIVEN the same action at the start and at the end of the check
    r, end = readings(recovery_action=code), readings(recovery_action=code)
    # WHEN judged
    result = check_recovery_action(r, "nvml", end)
    # THEN "none" passes, any other asks for the table's action
    expected = Status.PASS if action is None else Status.FAIL
    assert (result.status, result.action, result.device) == (expected, action, 2)


def test_a_recovery_action_unknown_to_dynprof_drains_and_says_so():
    # GIVEN an action code a newer driver may give
    result = check_recovery_action(readings(recovery_action=42), "nvml", readings(recovery_action=42))
    # THEN it is not ignored: the node is drained, and the code is named
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert "action 42, not known to dynprof" in result.reason


def test_the_worse_of_start_and_end_recovery_action_wins():
    # GIVEN a reset asked at the start, a reboot (drain) at the end
    result = check_recovery_action(readings(recovery_action=1), "nvml", readings(recovery_action=2))
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert result.details["readings"] == [1, 2]


def test_an_end_reading_without_the_recovery_fields_is_as_good_as_missing():
    # GIVEN an end reading taken but whose recovery fields failed
    end = readings(errors={"recovery_action": "NVML_ERROR_TIMEOUT"})
    # WHEN a start of "none" is judged
    result = check_recovery_action(readings(recovery_action=0), "nvml", end)
    # THEN unknown, naming the end's error
    assert result.status is Status.UNKNOWN
    assert "NVML_ERROR_TIMEOUT" in result.reason


def test_a_start_that_asks_for_recovery_fails_even_without_an_end():
    result = check_recovery_action(readings(recovery_action=1), "nvml", None, "did not return in 10 s")
    assert (result.status, result.action) == (Status.FAIL, "reset")


def test_reset_status_fields_at_the_end_are_judged_too():
    # GIVEN an older driver (no recovery action) whose reset status changed during the check
    r = readings(reset_required=False, drain_and_reset_recommended=False)
    end = readings(reset_required=True, drain_and_reset_recommended=False)
    result = check_recovery_action(r, "nvml", end)
    assert (result.status, result.action) == (Status.FAIL, "reset")


def test_drain_and_reset_recommended_wins_over_reset_required():
    r = readings(reset_required=True, drain_and_reset_recommended=True)
    result = check_recovery_action(r, "nvml", r)
    assert (result.status, result.action, result.value) == (Status.FAIL, "drain", "drain and reset")


def test_recovery_fields_not_exposed_by_an_smi_tool_are_skipped_naming_the_tool():
    r = readings(not_exposed={"recovery_action", "reset_required", "drain_and_reset_recommended"})
    result = check_recovery_action(r, "smi:ppu-smi")
    assert (result.status, result.reason) == (Status.SKIPPED, "not exposed by ppu-smi")


def test_recovery_fields_not_read_for_no_reason_are_unknown_naming_the_source():
    result = check_recovery_action(readings(), "smi:nvidia-smi")
    assert result.status is Status.UNKNOWN
    assert "not available through smi:nvidia-smi" in result.reason


# -- PCIe replays -----------------------------------------------------------------------------
def test_replays_during_the_check_fail_and_drain():
    result = check_pcie_replay(readings(pcie_replay_count=10), "nvml", readings(pcie_replay_count=13), 42.0)
    assert (result.status, result.action, result.value) == (Status.FAIL, "drain", 3)
    assert "3 PCIe replays in 42.0 s" in result.reason


def test_an_old_total_that_does_not_move_passes():
    # A total since the driver loaded is history, not a fault now.
    result = check_pcie_replay(readings(pcie_replay_count=500), "nvml", readings(pcie_replay_count=500), 5.0)
    assert (result.status, result.value) == (Status.PASS, 0)
    assert "500 since the driver loaded" in result.reason


def test_a_replay_counter_that_goes_backwards_is_unknown():
    result = check_pcie_replay(readings(pcie_replay_count=9), "nvml", readings(pcie_replay_count=2), 5.0)
    assert result.status is Status.UNKNOWN and "backwards" in result.reason


def test_a_missing_end_reading_is_unknown_with_its_reason():
    result = check_pcie_replay(readings(pcie_replay_count=0), "nvml", None, 5.0, "nvmlDeviceGetHandleByIndex hung")
    assert result.status is Status.UNKNOWN
    assert result.reason.endswith("nvmlDeviceGetHandleByIndex hung")


def test_an_end_reading_whose_counter_failed_is_unknown_with_the_error():
    end = readings(errors={"pcie_replay_count": "NVML: Unknown Error"})
    result = check_pcie_replay(readings(pcie_replay_count=0), "nvml", end, 5.0)
    assert result.status is Status.UNKNOWN and "NVML: Unknown Error" in result.reason


def test_a_replay_counter_the_device_lacks_is_skipped():
    r = readings(not_supported={"pcie_replay_count"})
    assert check_pcie_replay(r, "nvml", r, 5.0).status is Status.SKIPPED


# -- NVLink -----------------------------------------------------------------------------------
def link(n: int, active: bool = True, **counters) -> NvLinkReading:
    return NvLinkReading(link=n, active=active, **counters)


def test_a_rising_nvlink_counter_fails_with_a_reset_naming_link_and_counter():
    r = readings(nvlinks=[link(0, replay_errors=5, crc_flit_errors=1), link(1, replay_errors=0)])
    end = readings(nvlinks=[link(0, replay_errors=5, crc_flit_errors=4), link(1, replay_errors=0)])
    result = check_nvlink_errors(r, "nvml", end, 12.0)
    assert (result.status, result.action) == (Status.FAIL, "reset")
    assert "link 0 crc_flit +3" in result.reason
    assert result.details["deltas"] == {"0": {"replay_errors": 0, "crc_flit_errors": 3}, "1": {"replay_errors": 0}}


def test_steady_nvlink_counters_pass_and_count_the_links():
    r = readings(nvlinks=[link(0, replay_errors=7), link(1, replay_errors=0), link(2, active=False)])
    result = check_nvlink_errors(r, "nvml", r, 3.0)
    assert result.status is Status.PASS
    assert "on 2 links" in result.reason
    assert result.details["totals_at_start"]["replay_errors"] == 7


def test_a_link_whose_counters_vanish_at_the_end_is_unknown():
    r = readings(nvlinks=[link(0, replay_errors=0), link(1, replay_errors=0)])
    end = readings(nvlinks=[link(0, replay_errors=0)])
    result = check_nvlink_errors(r, "nvml", end, 3.0)
    assert result.status is Status.UNKNOWN and "[1]" in result.reason


def test_nvlink_counters_that_go_backwards_are_unknown():
    r = readings(nvlinks=[link(0, recovery_errors=4)])
    end = readings(nvlinks=[link(0, recovery_errors=1)])
    result = check_nvlink_errors(r, "nvml", end, 3.0)
    assert result.status is Status.UNKNOWN and "backwards" in result.reason


def test_a_rise_on_one_link_fails_even_when_another_link_was_lost():
    r = readings(nvlinks=[link(0, replay_errors=0), link(1, replay_errors=0)])
    end = readings(nvlinks=[link(0, replay_errors=2)])
    assert check_nvlink_errors(r, "nvml", end, 3.0).status is Status.FAIL


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"not_supported": {"nvlinks"}}, Status.SKIPPED),
        ({"not_exposed": {"nvlink_counters"}, "nvlinks": [link(0, replay_errors=0)]}, Status.SKIPPED),
        ({"nvlinks": [link(0, active=False)]}, Status.SKIPPED),
        ({"nvlinks": [link(0)], "not_supported": {"nvlink_counters"}}, Status.SKIPPED),
        ({"nvlinks": [link(0)]}, Status.UNKNOWN),
        ({"errors": {"nvlinks": "NVML: GPU is lost"}}, Status.UNKNOWN),
    ],
)
def test_nvlinks_that_cannot_be_judged_are_skipped_or_unknown_never_pass(fields, status):
    r = readings(**fields)
    assert check_nvlink_errors(r, "nvml", r, 3.0).status is status


def test_counter_checks_gives_the_three_checks_in_order_and_a_missing_end_is_never_a_pass():
    r = readings(recovery_action=0, pcie_replay_count=0, nvlinks=[link(0, replay_errors=0)])
    results = counter_checks(r, "nvml", None, 5.0, "not taken: the read hung")
    assert [x.name for x in results] == ["recovery_action", "pcie_replay", "nvlink_errors"]
    assert all(x.status is Status.UNKNOWN for x in results)
