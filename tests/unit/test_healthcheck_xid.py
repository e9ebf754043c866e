"""XID lines in the kernel-log formats the driver's messages reach us in, and the policy."""

from __future__ import annotations

import pytest

from healthcheck.backends.base import XidEvent
from healthcheck.checks.xid import check_kernel_log_xids, check_live_xids
from healthcheck.pci import normalize_bus_id
from healthcheck.result import Status
from healthcheck.xid import POLICY, parse_xid_line, policy_for

BOOT = 1_700_000_000.0

# Real message shapes as the NVIDIA driver writes them (pids and names vary).
KMSG = "3,1234,5234567890,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
DMESG = (
    "[ 5234.567890] NVRM: Xid (PCI:0000:18:00): 48, pid=22, name=python3, Ch 00000010, errorString CTX SWITCH TIMEOUT"
)
JOURNAL = (
    "1709633521.123456 gpu-node-17 kernel: NVRM: Xid (PCI:0000:9a:00): 94, pid='<unknown>', name=<unknown>, "
    "Contained: SM (0x1). RST: No, D-RST: No"
)
SYSLOG = "Mar  5 10:12:01 gpu-node-17 kernel: [ 123.450000] NVRM: Xid (PCI:0000:bb:00): 13, pid=998, name=train.py, Graphics SM Warp Exception"
GSP = (
    "[ 88.1] NVRM: Xid (PCI:0000:1b:00): 119, pid=3321, name=python, Timeout after 6s of waiting for RPC response "
    "from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4)."
)
RECOVERY = (
    "[ 9.0] NVRM: Xid (PCI:0000:1b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
)
RECOVERY_REBOOT = (
    "[ 9.0] NVRM: Xid (PCI:0000:1b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
)


def test_kmsg_record_gives_time_bus_and_xid():
    record = parse_xid_line(KMSG, boot_time=BOOT)
    assert record is not None
    assert (record.xid, record.bus_id) == (79, "0000:3b:00")
    assert record.time == pytest.approx(BOOT + 5234.56789)
    assert record.policy.action == "drain"


def test_kmsg_continuation_lines_are_ignored():
    record = parse_xid_line(KMSG.rstrip("\n") + "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n", boot_time=BOOT)
    assert record is not None and record.xid == 79


def test_dmesg_journal_and_syslog_formats():
    dmesg = parse_xid_line(DMESG, boot_time=BOOT)
    journal = parse_xid_line(JOURNAL)
    syslog = parse_xid_line(SYSLOG)
    assert dmesg is not None and (dmesg.xid, dmesg.bus_id, dmesg.time) == (48, "0000:18:00", BOOT + 5234.56789)
    assert journal is not None and (journal.xid, journal.bus_id, journal.time) == (94, "0000:9a:00", 1709633521.123456)
    assert syslog is not None and (syslog.xid, syslog.bus_id) == (13, "0000:bb:00")
    assert "Contained" in journal.message


def test_lines_without_an_xid_are_ignored():
    assert parse_xid_line("[ 1.0] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15") is None
    assert parse_xid_line("[ 2.0] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal") is None


@pytest.mark.parametrize(("line", "action"), [(GSP, "reset"), (RECOVERY, "reset"), (RECOVERY_REBOOT, "drain")])
def test_policy_of_gsp_timeout_and_recovery_action(line, action):
    record = parse_xid_line(line)
    assert record is not None and record.policy.action == action


def test_policy_table_covers_the_common_xids_with_a_reason():
    for xid in (13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120):
        assert xid in POLICY and POLICY[xid].why
    assert policy_for(99999).action == "warn" and "not in dynprof's policy table" in policy_for(99999).meaning


def test_bus_ids_from_nvml_kernel_and_torch_normalise_alike():
    assert normalize_bus_id("00000000:3B:00.0") == normalize_bus_id("0000:3b:00") == normalize_bus_id("3b:00.0")
    assert normalize_bus_id("garbage") is None


def test_kernel_log_xids_are_judged_per_device():
    # GIVEN XID 79 on device 1's bus, XID 13 on device 0's, and XID 94 on a bus we do not check
    records = [parse_xid_line(line, BOOT) for line in (KMSG, SYSLOG, JOURNAL)]
    devices = {"0000:bb:00": 0, "0000:3b:00": 1}
    # WHEN judged
    results = {r.device: r for r in check_kernel_log_xids([r for r in records if r], devices, 3600, "/dev/kmsg")}
    # THEN device 1 must be drained, device 0 warns (application error), the stranger warns on the node
    assert results[1].status is Status.FAIL and results[1].action == "drain" and results[1].value == "79"
    assert results[0].status is Status.WARN and results[0].action is None
    assert results[None].status is Status.WARN and "not checked here" in results[None].reason


def test_no_xid_passes_every_device():
    results = check_kernel_log_xids([], {"0000:bb:00": 0}, 3600, "/dev/kmsg")
    assert [(r.device, r.status) for r in results] == [(0, Status.PASS)]


def test_live_xids_and_a_backend_that_cannot_listen():
    assert check_live_xids([], False, [0, 1])[0].status is Status.UNKNOWN
    results = {r.device: r for r in check_live_xids([XidEvent(0, 48), XidEvent(0, 63)], True, [0, 1])}
    assert results[0].status is Status.FAIL and results[0].action == "reset"
    assert results[1].status is Status.PASS


def test_documented_policy_table_is_the_code_table():
    from pathlib import Path

    # GIVEN the XID table in docs/healthcheck.md
    doc = (Path(__file__).resolve().parents[2] / "docs" / "healthcheck.md").read_text()
    table = doc.split("<!-- xid-policy-table")[1].split("<!-- end xid-policy-table")[0]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    # THEN it lists exactly the policy the code applies
    documented = {int(r[0]): (r[1].strip(), r[2].strip(), r[3].strip()) for r in rows}
    assert documented == {x: (p.meaning, p.action, p.why) for x, p in POLICY.items()}
