"""The options of one healthcheck run (:func:`healthcheck.runner.run`), as the request makes them
(:meth:`healthcheck.collect.HealthcheckRequest.options`), and what they decide before any probe."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from healthcheck.checks.ib_counters import IB_ROOT
from healthcheck.compare import Thresholds
from healthcheck.timeouts import PROBE_TIMEOUT_S

LEVELS = ("quick", "standard", "full")
EXPECT_ENV = ("DYNPROF_EXPECT_DEVICES", "SLURM_GPUS_ON_NODE")

SHARED_FS_ENV = "DYNPROF_HEALTHCHECK_SHARED_FS"


@dataclass
class Options:
    level: str = "quick"
    backend: str = "auto"
    smi_tool: str | None = None
    expect_devices: int | None = None
    disk_paths: list[str] = field(default_factory=lambda: ["/", "/tmp"])
    min_disk_gib: float = 10.0
    xid_window_s: float = 3600.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    baseline_paths: list[str] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)
    timeout_scale: float = 1.0
    # The time limit of every passive probe (a driver call, a tool run, a filesystem probe).
    probe_timeout_s: float = PROBE_TIMEOUT_S
    # Shared filesystems to probe (--shared-fs; default: $DYNPROF_HEALTHCHECK_SHARED_FS, ':'-separated).
    shared_fs: list[str] | None = None
    ib_root: str = IB_ROOT
    # The least time between the two readings of the error counters (0: the start and the end
    # of the run, whatever it took).
    counter_window_s: float = 0.0
    # The processes of the job the node runs (--job): device_processes does not count them as
    # others holding the devices (a watch's verdict checks the nodes of the job it names).
    job_pids: frozenset[int] = frozenset()

    def shared_fs_paths(self) -> list[str]:
        if self.shared_fs is not None:
            return list(self.shared_fs)
        return [p for p in os.environ.get(SHARED_FS_ENV, "").split(os.pathsep) if p.strip()]

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["thresholds"] = self.thresholds.__dict__
        data["skip"] = sorted(self.skip)
        data["shared_fs"] = self.shared_fs_paths()
        data["job_pids"] = sorted(self.job_pids)
        data["read_timeout_s"] = self.probe_timeout_s  # the name before every probe had a limit
        return data


def expected_devices(options: Options) -> tuple[int | None, str]:
    if options.expect_devices is not None:
        return options.expect_devices, "--expect-devices"
    for name in EXPECT_ENV:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None, ""


def visible_cuda_count(backend_count: int) -> int:
    """How many devices CUDA will show (CUDA_VISIBLE_DEVICES may hide some)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return backend_count
    entries = [e for e in visible.split(",") if e.strip()]
    return min(len(entries), backend_count)
