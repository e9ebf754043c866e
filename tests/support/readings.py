"""The readings of a healthy fake GPU, for the healthcheck's tests over a fake backend.

``healthy_readings(index, links, **fields)`` is device ``index`` of a node where nothing is
wrong: ECC on with no errors, no remapped rows, its PCIe link at its best, cool, ``links``
NVLinks up without errors, no processes; ``fields`` change what a test is about.
"""

from __future__ import annotations

from typing import Any

from healthcheck.readings import DeviceReadings, NvLinkReading


def healthy_readings(index: int, links: int, **fields: Any) -> DeviceReadings:
    base: dict[str, Any] = dict(
        name="Fake GPU",
        uuid=f"GPU-{index}",
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        memory_total_bytes=80 * 1024**3,
        persistence_mode=True,
        ecc_enabled=True,
        ecc_pending_enabled=True,
        ecc_uncorrected_volatile=0,
        ecc_uncorrected_aggregate=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        remap_pending=False,
        remap_failure=False,
        remap_banks_exhausted=0,
        pcie_gen_current=5,
        pcie_gen_max=5,
        pcie_width_current=16,
        pcie_width_max=16,
        clock_event_reasons=0x1,
        temperature_c=35,
        temperature_slowdown_c=87,
        nvlinks=[NvLinkReading(link, True, 0, 0, 0, 0) for link in range(links)],
        processes=[],
        pcie_replay_count=0,
        recovery_action=0,
    )
    base.update(fields)
    return DeviceReadings(index=index, **base)
