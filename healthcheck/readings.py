"""What a backend reads from one accelerator, before any judgement.

Every field is ``None`` when it was not read. Why it was not read is recorded so that a check
can tell the three cases apart:

* the field's name is in :attr:`DeviceReadings.not_supported`: the device says it has no such
  feature (retired pages on a GPU that remaps rows, ECC on a card without it): the check is
  skipped;
* the field's name is in :attr:`DeviceReadings.errors`: reading it failed (with the error);
* the field's name is in :attr:`DeviceReadings.not_exposed`: the backend has no way to read it
  at all (an smi tool without such a query field): the deeper checks are skipped with
  "not exposed by <tool>";
* none of these: the backend could not say (an smi tool without that query field, for the
  older checks).

In the error and "could not say" cases the check is "unknown", never "pass".
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Clock event ("throttle") reason bits, as NVML and nvidia-smi define them.
CLOCK_GPU_IDLE = 0x1
CLOCK_APPLICATIONS_SETTING = 0x2
CLOCK_SW_POWER_CAP = 0x4
CLOCK_HW_SLOWDOWN = 0x8
CLOCK_SYNC_BOOST = 0x10
CLOCK_SW_THERMAL = 0x20
CLOCK_HW_THERMAL = 0x40
CLOCK_HW_POWER_BRAKE = 0x80
CLOCK_DISPLAY_SETTING = 0x100

CLOCK_REASON_NAMES = {
    CLOCK_GPU_IDLE: "gpu_idle",
    CLOCK_APPLICATIONS_SETTING: "applications_clocks_setting",
    CLOCK_SW_POWER_CAP: "sw_power_cap",
    CLOCK_HW_SLOWDOWN: "hw_slowdown",
    CLOCK_SYNC_BOOST: "sync_boost",
    CLOCK_SW_THERMAL: "sw_thermal_slowdown",
    CLOCK_HW_THERMAL: "hw_thermal_slowdown",
    CLOCK_HW_POWER_BRAKE: "hw_power_brake_slowdown",
    CLOCK_DISPLAY_SETTING: "display_clock_setting",
}


def clock_reason_names(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_REASON_NAMES.items() if mask & bit]


@dataclass
class NvLinkReading:
    link: int
    active: bool
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_flit_errors: int | None = None
    crc_data_errors: int | None = None

    def counters(self) -> dict[str, int]:
        """The error counters that were read, by name."""
        return {name: value for name in NVLINK_COUNTERS if (value := getattr(self, name)) is not None}


# The NVLink error counters, in report order.
NVLINK_COUNTERS = ("replay_errors", "recovery_errors", "crc_flit_errors", "crc_data_errors")


@dataclass
class DeviceProcess:
    pid: int
    used_memory_bytes: int | None = None
    name: str | None = None


@dataclass
class DeviceReadings:
    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    driver_version: str | None = None
    persistence_mode: bool | None = None
    ecc_enabled: bool | None = None
    ecc_pending_enabled: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_volatile: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    # Memory banks without a spare row left (the "none" bucket of the remapper histogram).
    remap_banks_exhausted: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    clock_event_reasons: int | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    temperature_c: int | None = None
    temperature_slowdown_c: int | None = None
    temperature_shutdown_c: int | None = None
    nvlinks: list[NvLinkReading] | None = None
    processes: list[DeviceProcess] | None = None
    # PCIe replays (link-level retransmissions) since the driver loaded.
    pcie_replay_count: int | None = None
    # The driver's GPU recovery action (NVML_GPU_RECOVERY_ACTION_*: 0 none, 1 GPU reset, 2 node
    # reboot, 3 drain peer-to-peer, 4 drain and reset, 5 recover the IMEX domain, 6 bus reset,
    # 7 system reboot), and the older reset status fields it replaces.
    recovery_action: int | None = None
    reset_required: bool | None = None
    drain_and_reset_recommended: bool | None = None
    not_supported: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    not_exposed: set[str] = field(default_factory=set)

    @property
    def memory_gib(self) -> int | None:
        if self.memory_total_bytes is None:
            return None
        return round(self.memory_total_bytes / 1024**3)

    @property
    def sku(self) -> str:
        """The device's SKU key: its name and memory size (e.g. ``NVIDIA H200 140GiB``)."""
        name = self.name or "unknown device"
        return f"{name} {self.memory_gib}GiB" if self.memory_gib is not None else name
