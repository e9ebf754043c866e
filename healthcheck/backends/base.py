"""The interface every backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dynprof.errors import DynprofError
from healthcheck.readings import DeviceReadings


class NoAccelerator(DynprofError):
    """No accelerator could be found or its management library could not be loaded."""

    exit_code = 3
    default_help = (
        "Check that the driver is loaded (`nvidia-smi` or `ppu-smi` lists the devices) and that "
        "this container was given the devices (--gpus all; Kubernetes resources.limits "
        "nvidia.com/gpu). On a node without accelerators, pass --expect-devices 0 to run the "
        "host checks only."
    )


@dataclass
class XidEvent:
    """An XID reported live by the driver while the healthcheck ran."""

    device: int | None
    xid: int


class Backend(Protocol):
    name: str

    def device_count(self) -> int: ...

    def driver_version(self) -> str | None: ...

    def read(self, index: int) -> DeviceReadings:
        """Every reading of device ``index``; one that fails is recorded, never raised."""
        ...

    def read_counters(self, index: int) -> DeviceReadings:
        """What may change during the check (PCIe replays, the recovery action, NVLink error
        counters), read again at its end; a backend may also have ``call_in_flight(thread_id)``,
        naming the driver call a thread is in (for a call that did not return)."""
        ...

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        """The current PCIe link generation and width of device ``index``."""
        ...

    def watch_xid(self) -> bool:
        """Start listening for XID events; False if this backend cannot."""
        ...

    def xid_events(self) -> list[XidEvent]:
        """The XID events received since :meth:`watch_xid`."""
        ...

    def close(self) -> None: ...
