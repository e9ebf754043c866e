"""healthcheck.checks.table: one row per passive and host check; the names --skip takes come from
the rows, a device's judgements run in the rows' order, a host probe per row (one per disk)."""

from __future__ import annotations

from healthcheck.checks.table import (
    ALL_CHECKS,
    HOST_CHECKS,
    PASSIVE,
    PASSIVE_CHECKS,
    Reads,
    host_probes,
    passive_device_checks,
)
from healthcheck.readings import DeviceProcess, DeviceReadings, NvLinkReading
from healthcheck.result import Status


def readings(**fields) -> DeviceReadings:
    return DeviceReadings(index=3, **fields)


def test_the_names_are_the_rows_in_report_order_each_once():
    assert PASSIVE_CHECKS + HOST_CHECKS == tuple(p.name for p in PASSIVE)
    assert len(ALL_CHECKS) == len(set(ALL_CHECKS))
    assert PASSIVE_CHECKS[:3] == ("accelerators", "devices", "driver")
    assert HOST_CHECKS == (
        "disk_free",
        "shm_size",
        "host_memory",
        "host_processes",
        "ib_ports",
        "ib_counters",
        "shared_fs",
    )


def test_a_row_judged_from_a_probe_names_its_function_and_only_such_rows_do():
    for p in PASSIVE:
        assert (p.judge is not None) == (p.reads is Reads.DEVICE), p.name
        assert (p.probes is not None) == (p.reads is Reads.HOST), p.name


def test_passive_device_checks_run_every_check_but_the_pcie_link_once():
    got = passive_device_checks(readings(), "nvml")
    names = [r.name for r in got]
    assert len(names) == len(set(names)) == 9
    assert not any("pcie" in n for n in names), "the PCIe link needs a loaded reading"
    assert all(r.device == 3 for r in got)


def test_passive_device_checks_on_a_device_with_nothing_read_never_pass():
    # GIVEN readings where nothing could be read
    got = passive_device_checks(readings(), "smi:ppu-smi")
    # THEN no check passes on missing data
    assert not [r.name for r in got if r.status is Status.PASS]


def test_passive_device_checks_pass_our_own_pids_and_the_peers_links_through():
    r = readings(processes=[DeviceProcess(pid=4242)], nvlinks=[NvLinkReading(0, True)])
    got = {x.name: x for x in passive_device_checks(r, "nvml", peer_nvlinks=4, own_pids=frozenset({4242}))}
    nvlink = next(x for name, x in got.items() if name.startswith("nvlink"))
    processes = next(x for name, x in got.items() if "process" in name)
    assert nvlink.status is Status.FAIL, "1 active link where peers have 4"
    assert processes.status is Status.PASS, "our own process is not another user's"


def test_host_probes_give_one_probe_per_disk_and_one_per_other_check(tmp_path):
    probes = host_probes([str(tmp_path), "/"], 0, ib_root=tmp_path / "no-ib")
    names = [name for name, _, _ in probes]
    assert names == ["disk_free", "disk_free", "shm_size", "host_memory", "host_processes", "ib_ports"]
    assert probes[0][1] == f"statvfs of {tmp_path}"
    # WHEN the first disk probe and the IB probe run
    [disk] = probes[0][2]()
    [ib_result] = probes[-1][2]()
    # THEN each probe reads what it names
    assert disk.details["path"] == str(tmp_path)
    assert ib_result.status is Status.SKIPPED
