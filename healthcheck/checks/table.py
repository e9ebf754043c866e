"""The passive and host checks, one row each: its name (what ``--skip`` takes and the report
lists, in this order) and what it reads; a check judged from what one probe read names its
function in its row.

* ``Reads.DEVICE``: judged from one device's readings (:mod:`healthcheck.checks.device`):
  ``judge(readings, context)``, every device in the rows' order (:func:`passive_device_checks`).
* ``Reads.HOST``: a probe of the host (:mod:`healthcheck.checks.host`), run under its own time
  limit: ``probes(context)`` gives ``(what it reads, probe)`` pairs (:func:`host_probes`).
* The others are run by the runner itself, in its steps: the backend (opening it, counting and
  naming the devices), the PCIe link under load, the error counters at both ends of the run
  (:func:`healthcheck.checks.counters.counter_checks`), the XIDs, the InfiniBand counters and the
  shared filesystems.

A new check judged from a device's readings, or from one probe of the host, is its function and
its row here (the functional checks have their own rows: :mod:`healthcheck.functional.table`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from healthcheck.checks import host
from healthcheck.checks.device import (
    check_clocks,
    check_ecc_errors,
    check_ecc_mode,
    check_nvlink,
    check_persistence_mode,
    check_processes,
    check_retired_pages,
    check_row_remap,
    check_temperature,
)
from healthcheck.functional.table import HOST_FUNCTIONAL_CHECKS, Scope, result_names
from healthcheck.readings import DeviceReadings
from healthcheck.result import CheckResult

DEFAULT_IB_ROOT = "/sys/class/infiniband"


class Reads(enum.Enum):
    BACKEND = "backend"  # the backend itself: opened, its devices counted, its driver named
    DEVICE = "device"  # one device's readings
    LOADED = "loaded"  # a device's PCIe link, re-read under load where it is below its maximum
    COUNTERS = "counters"  # a device's error counters at the start and the end of the run
    EVENTS = "events"  # XIDs: the kernel log, the driver's live events
    HOST = "host"  # one probe of the host each
    HOST_RUN = "host_run"  # host readings the runner takes itself (at both ends, in a child)


@dataclass(frozen=True)
class DeviceContext:
    """What a device's judgement knows besides its readings."""

    source: str  # the backend's name
    peer_nvlinks: int | None = None  # the most active links a device of its SKU has here
    own_pids: frozenset[int] = frozenset()  # this process and the job's (not "other processes")


@dataclass(frozen=True)
class HostContext:
    disk_paths: tuple[str, ...]
    min_disk_gib: float
    ib_root: str


Probe = Callable[[], list[CheckResult]]


@dataclass(frozen=True)
class Passive:
    name: str
    reads: Reads
    judge: Callable[[DeviceReadings, DeviceContext], CheckResult] | None = None  # Reads.DEVICE
    probes: Callable[[HostContext], list[tuple[str, Probe]]] | None = None  # Reads.HOST


def _disks(c: HostContext) -> list[tuple[str, Probe]]:
    def disk(path: str) -> Probe:
        return lambda: [host.read_disk(path, c.min_disk_gib)]

    return [(f"statvfs of {p}", disk(p)) for p in c.disk_paths]


PASSIVE: tuple[Passive, ...] = (
    Passive("accelerators", Reads.BACKEND),
    Passive("devices", Reads.BACKEND),
    Passive("driver", Reads.BACKEND),
    Passive("persistence_mode", Reads.DEVICE, lambda r, c: check_persistence_mode(r, c.source)),
    Passive("ecc_mode", Reads.DEVICE, lambda r, c: check_ecc_mode(r, c.source)),
    Passive("ecc_errors", Reads.DEVICE, lambda r, c: check_ecc_errors(r, c.source)),
    Passive("row_remap", Reads.DEVICE, lambda r, c: check_row_remap(r, c.source)),
    Passive("retired_pages", Reads.DEVICE, lambda r, c: check_retired_pages(r, c.source)),
    Passive("pcie_link", Reads.LOADED),
    Passive("clock_events", Reads.DEVICE, lambda r, c: check_clocks(r, c.source)),
    Passive("temperature", Reads.DEVICE, lambda r, c: check_temperature(r, c.source)),
    Passive("nvlink", Reads.DEVICE, lambda r, c: check_nvlink(r, c.source, c.peer_nvlinks)),
    Passive("nvlink_errors", Reads.COUNTERS),
    Passive("recovery_action", Reads.COUNTERS),
    Passive("pcie_replay", Reads.COUNTERS),
    Passive("device_processes", Reads.DEVICE, lambda r, c: check_processes(r, c.source, c.own_pids)),
    Passive("xid_kernel_log", Reads.EVENTS),
    Passive("xid_live", Reads.EVENTS),
    Passive("disk_free", Reads.HOST, probes=_disks),
    Passive("shm_size", Reads.HOST, probes=lambda c: [("statvfs of /dev/shm", lambda: [host.read_shm()])]),
    Passive("host_memory", Reads.HOST, probes=lambda c: [("reading the host memory", lambda: [host.read_memory()])]),
    Passive("host_processes", Reads.HOST, probes=lambda c: [("reading /proc", lambda: [host.read_process_states()])]),
    Passive(
        "ib_ports", Reads.HOST, probes=lambda c: [(f"reading {c.ib_root}", lambda: host.read_ib_ports(Path(c.ib_root)))]
    ),
    Passive("ib_counters", Reads.HOST_RUN),
    Passive("shared_fs", Reads.HOST_RUN),
)

# Every check name, in report order (for --skip and the docs).
PASSIVE_CHECKS = tuple(p.name for p in PASSIVE if p.reads not in (Reads.HOST, Reads.HOST_RUN))
# The functional checks' results, from their rows (healthcheck.functional.table); the host's
# own figures are HOST_FUNCTIONAL_CHECKS.
FUNCTIONAL_CHECKS = result_names(Scope.DEVICE, Scope.NODE)
HOST_CHECKS = tuple(p.name for p in PASSIVE if p.reads in (Reads.HOST, Reads.HOST_RUN))
ALL_CHECKS = PASSIVE_CHECKS + FUNCTIONAL_CHECKS + HOST_CHECKS + HOST_FUNCTIONAL_CHECKS


def passive_device_checks(
    r: DeviceReadings, source: str, *, peer_nvlinks: int | None = None, own_pids: frozenset[int] = frozenset()
) -> list[CheckResult]:
    """Every passive check of one device judged from its readings (the PCIe link, which needs a
    loaded reading, and the counters, read at both ends, are the runner's)."""
    context = DeviceContext(source, peer_nvlinks, own_pids)
    return [p.judge(r, context) for p in PASSIVE if p.judge is not None]


def host_probes(
    disk_paths: list[str], min_disk_gib: float, ib_root: str | Path = DEFAULT_IB_ROOT
) -> list[tuple[str, str, Probe]]:
    """``(check name, what it reads, probe)`` for every host check, so that each runs under its
    own time limit (a hung disk does not take the memory check with it)."""
    context = HostContext(tuple(disk_paths), min_disk_gib, str(ib_root))
    return [(p.name, what, probe) for p in PASSIVE if p.probes is not None for what, probe in p.probes(context)]
