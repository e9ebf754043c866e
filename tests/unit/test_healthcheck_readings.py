"""healthcheck.readings: a device's readings before any judgement (the SKU key, NVLink counters,
clock event reason names)."""

from __future__ import annotations

from healthcheck.readings import (
    CLOCK_GPU_IDLE,
    CLOCK_HW_POWER_BRAKE,
    CLOCK_HW_THERMAL,
    CLOCK_REASON_NAMES,
    CLOCK_SW_POWER_CAP,
    NVLINK_COUNTERS,
    DeviceReadings,
    NvLinkReading,
    clock_reason_names,
)

GIB = 1024**3


def test_no_clock_reason_bits_give_no_names():
    assert clock_reason_names(0) == []


def test_each_set_bit_gives_its_name():
    # GIVEN a mask with the idle, power cap and hardware thermal bits
    mask = CLOCK_GPU_IDLE | CLOCK_SW_POWER_CAP | CLOCK_HW_THERMAL
    # WHEN named
    names = clock_reason_names(mask)
    # THEN exactly those names, in the table's order
    assert names == ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]


def test_unknown_bits_are_ignored():
    # A driver newer than the table may set bits it does not know.
    assert clock_reason_names(CLOCK_HW_POWER_BRAKE | 0x10000) == ["hw_power_brake_slowdown"]


def test_every_known_bit_is_one_distinct_power_of_two():
    bits = list(CLOCK_REASON_NAMES)
    assert all(b & (b - 1) == 0 for b in bits), "each reason is one bit"
    assert len(set(CLOCK_REASON_NAMES.values())) == len(bits)
    assert clock_reason_names(sum(bits)) == list(CLOCK_REASON_NAMES.values())


def test_nvlink_counters_give_only_what_was_read_in_report_order():
    # GIVEN a link whose replay and CRC data counters were read, the others not
    link = NvLinkReading(link=0, active=True, replay_errors=0, crc_data_errors=7)
    # WHEN its counters are asked for
    # THEN a counter that was not read is absent (not 0), and a 0 that was read is kept
    assert link.counters() == {"replay_errors": 0, "crc_data_errors": 7}
    assert list(link.counters()) == [c for c in NVLINK_COUNTERS if c in link.counters()]


def test_a_link_without_readings_has_no_counters():
    assert NvLinkReading(link=3, active=False).counters() == {}


def test_every_counter_name_is_a_field_of_the_link():
    link = NvLinkReading(0, True, 1, 2, 3, 4)
    assert link.counters() == dict(zip(NVLINK_COUNTERS, [1, 2, 3, 4], strict=True))


def test_memory_gib_rounds_the_bytes_the_driver_reports():
    # GIVEN a device reporting slightly less than 141 GiB (drivers reserve some)
    r = DeviceReadings(index=0, memory_total_bytes=140 * GIB + GIB * 3 // 4)
    # THEN it rounds to the nearest GiB
    assert r.memory_gib == 141
    assert DeviceReadings(index=0, memory_total_bytes=80 * GIB + GIB // 4).memory_gib == 80


def test_memory_not_read_is_none_not_zero():
    assert DeviceReadings(index=0).memory_gib is None


def test_sku_is_name_and_memory_size():
    r = DeviceReadings(index=0, name="NVIDIA H200", memory_total_bytes=140 * GIB)
    assert r.sku == "NVIDIA H200 140GiB"


def test_sku_without_a_memory_reading_is_the_name_alone():
    assert DeviceReadings(index=0, name="PPU").sku == "PPU"


def test_sku_of_a_device_without_a_name_says_so():
    assert DeviceReadings(index=0).sku == "unknown device"
    assert DeviceReadings(index=0, memory_total_bytes=16 * GIB).sku == "unknown device 16GiB"


def test_fields_not_read_are_none_and_the_why_sets_are_empty_and_not_shared():
    # GIVEN two fresh readings
    a, b = DeviceReadings(index=0), DeviceReadings(index=1)
    # THEN every field is None until read, and the error records are per device
    assert a.ecc_enabled is None and a.nvlinks is None and a.recovery_action is None
    a.errors["ecc_enabled"] = "NVML: Unknown Error"
    a.not_supported.add("retired_pages_sbe")
    a.not_exposed.add("pcie_replay_count")
    assert b.errors == {} and b.not_supported == set() and b.not_exposed == set()
