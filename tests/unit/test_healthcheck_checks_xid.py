"""healthcheck.checks.xid: the kernel log's XIDs judged per device (and on the node for a bus
not checked here), and the XIDs the backend saw live during the run."""

from __future__ import annotations

from healthcheck.backends.base import XidEvent
from healthcheck.checks.xid import DRAIN, RESET, check_kernel_log_xids, check_live_xids
from healthcheck.result import Status
from healthcheck.xid import XidRecord

BUS_A, BUS_B = "0000:3b:00", "0000:5e:00"
DEVICES = {BUS_A: 0, BUS_B: 1}


def record(xid: int, bus: str | None, message: str = "") -> XidRecord:
    return XidRecord(xid=xid, bus_id=bus, message=message)


def by_device(results):
    return {r.device: r for r in results}


def test_a_device_without_xids_passes_and_one_with_a_drain_xid_fails_with_drain():
    # GIVEN XID 79 (fallen off the bus) on the second device
    results = by_device(check_kernel_log_xids([record(79, BUS_B)], DEVICES, 3600, "/dev/kmsg"))
    # THEN device 0 passes, device 1 fails and asks for a drain
    assert results[0].status is Status.PASS and results[0].value == 0
    assert (results[1].status, results[1].action) == (Status.FAIL, DRAIN)
    assert "XID 79" in results[1].reason and "/dev/kmsg" in results[1].reason


def test_the_worst_action_of_a_devices_xids_wins():
    # GIVEN a warning XID (13), a reset XID (48) and the warning again on one device
    records = [record(13, BUS_A), record(48, BUS_A), record(13, BUS_A)]
    # WHEN judged
    result = by_device(check_kernel_log_xids(records, DEVICES, 600, "dmesg"))[0]
    # THEN the reset wins, the value lists each XID once in order, and the reason counts all three
    assert (result.status, result.action) == (Status.FAIL, RESET)
    assert result.value == "13,48"
    assert result.reason.startswith("3 XID")
    assert [x["xid"] for x in result.details["xids"]] == [13, 48, 13]


def test_only_warning_xids_warn_without_an_action():
    result = by_device(check_kernel_log_xids([record(31, BUS_A)], DEVICES, 600, "dmesg"))[0]
    assert result.status is Status.WARN
    assert result.action is None, "warn is not an action the scheduler takes"


def test_an_xid_not_in_the_policy_table_warns_and_says_so():
    result = by_device(check_kernel_log_xids([record(999, BUS_A)], DEVICES, 600, "dmesg"))[0]
    assert result.status is Status.WARN
    assert "not in dynprof's policy table" in result.reason


def test_an_xid_of_a_bus_not_checked_here_is_only_a_warning_on_the_node():
    # GIVEN XID 79 on a PCI device this container was not given
    results = check_kernel_log_xids([record(79, "0000:af:00")], DEVICES, 600, "dmesg")
    node = by_device(results)[None]
    # THEN it is reported on the node, downgraded to a warning, and says why
    assert node.status is Status.WARN
    assert node.reason.endswith("(on a PCI device not checked here)")
    # AND the node's result comes first, then the devices in order
    assert [r.device for r in results] == [None, 0, 1]


def test_an_xid_without_a_bus_id_goes_to_the_node():
    results = by_device(check_kernel_log_xids([record(48, None)], DEVICES, 600, "dmesg"))
    assert results[None].status is Status.WARN
    assert results[0].status is Status.PASS and results[1].status is Status.PASS


def test_xid_154_follows_the_action_the_driver_names():
    # GIVEN the recovery-action XID whose message asks for a node reboot
    msg = "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    result = by_device(check_kernel_log_xids([record(154, BUS_A, msg)], DEVICES, 600, "dmesg"))[0]
    # THEN the node is drained, whatever the table's default for 154
    assert (result.status, result.action) == (Status.FAIL, DRAIN)


def test_the_window_is_given_in_minutes():
    results = check_kernel_log_xids([], DEVICES, 7200, "journalctl")
    assert all("in the last 120 min" in r.reason for r in results)


def test_no_devices_and_no_xids_still_gives_one_passing_result():
    # GIVEN a node without devices (host checks only) and a clean log
    results = check_kernel_log_xids([], {}, 600, "dmesg")
    # THEN the check still reports, on the node
    assert len(results) == 1
    assert (results[0].status, results[0].device, results[0].name) == (Status.PASS, None, "xid_kernel_log")


def test_details_keep_at_most_fifty_xids():
    # GIVEN a log flooded with one device's XIDs
    records = [record(13, BUS_A) for _ in range(500)]
    result = by_device(check_kernel_log_xids(records, DEVICES, 600, "dmesg"))[0]
    # THEN the result stays small but the count is the real one
    assert len(result.details["xids"]) == 50
    assert result.reason.startswith("500 XID")


def test_live_xids_are_unknown_when_the_backend_cannot_listen():
    results = check_live_xids([XidEvent(0, 79)], watching=False, device_indices=[0])
    assert len(results) == 1
    assert results[0].status is Status.UNKNOWN, "not listening is never a pass"


def test_live_xids_are_judged_per_device_and_on_the_node():
    # GIVEN a reset XID on device 1 and an XID the driver gave without a device
    events = [XidEvent(1, 95), XidEvent(None, 13)]
    # WHEN judged for devices 0 and 1
    results = check_live_xids(events, watching=True, device_indices=[0, 1])
    # THEN one result each, the node's first
    assert [r.device for r in results] == [None, 0, 1]
    got = by_device(results)
    assert got[0].status is Status.PASS
    assert (got[1].status, got[1].action) == (Status.FAIL, RESET)
    assert got[None].status is Status.WARN
    assert all(r.name == "xid_live" for r in results)


def test_a_live_drain_xid_on_the_node_is_not_downgraded():
    # Unlike the kernel log, a live event without a device is this node's own.
    results = by_device(check_live_xids([XidEvent(None, 79)], watching=True, device_indices=[0]))
    assert (results[None].status, results[None].action) == (Status.FAIL, DRAIN)
