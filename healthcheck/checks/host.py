"""Host checks: disk, /dev/shm, memory, stuck processes, InfiniBand / RoCE ports.

Each check has a ``read_*`` function that looks at the machine and a ``check_*`` function that
judges what was read, so the judgement is tested without the machine. A judgement is a decision
table (:func:`healthcheck.result.decide`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from healthcheck.result import OTHERWISE, CheckResult, Status, decide, row

GIB = 1024**3


# -- disk ---------------------------------------------------------------------------------------
def check_disk(path: str, total: int, free: int, min_free_gib: float) -> CheckResult:
    return decide(
        "disk_free",
        [
            row(free < min_free_gib * GIB / 4 or free < GIB // 2, Status.FAIL, f"{path}: almost full", action="drain"),
            row(free < min_free_gib * GIB, Status.WARN, f"{path}: low on space"),
            row(OTHERWISE, Status.PASS, f"{path}: enough free space"),
        ],
        value=round(free / GIB, 1),
        unit="GiB",
        expected=f">= {min_free_gib:g} GiB",
        details={"path": path, "total_bytes": total, "free_bytes": free},
    )


def read_disk(path: str, min_free_gib: float) -> CheckResult:
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return CheckResult("disk_free", Status.UNKNOWN, f"{path}: {exc.strerror or exc}", details={"path": path})
    return check_disk(path, usage.total, usage.free, min_free_gib)


# -- /dev/shm ---------------------------------------------------------------------------------
SHM_FAIL_BYTES = 1 * GIB
SHM_WARN_BYTES = 8 * GIB


def check_shm(total: int | None) -> CheckResult:
    name = "shm_size"
    if total is None:
        return CheckResult(
            name, Status.FAIL, "/dev/shm is missing: NCCL and DataLoader workers need it", action="drain"
        )
    return decide(
        name,
        [
            row(
                total < SHM_FAIL_BYTES,
                Status.FAIL,
                "/dev/shm is tiny (containers default to 64 MiB): NCCL and DataLoader workers fail; "
                "docker run --shm-size / Kubernetes emptyDir medium: Memory",
                action="drain",
            ),
            row(total < SHM_WARN_BYTES, Status.WARN, "/dev/shm is small for multi-GPU jobs"),
            row(OTHERWISE, Status.PASS, "/dev/shm is large enough"),
        ],
        value=round(total / GIB, 2),
        unit="GiB",
        expected=">= 8 GiB",
    )


def read_shm() -> CheckResult:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except FileNotFoundError:
        return check_shm(None)
    except OSError as exc:
        return CheckResult("shm_size", Status.UNKNOWN, f"/dev/shm: {exc.strerror or exc}")
    return check_shm(usage.total)


# -- memory ----------------------------------------------------------------------------------
def check_memory(total: int, available: int) -> CheckResult:
    share = available / total if total else 0.0
    return decide(
        "host_memory",
        [
            row(
                share < 0.05 or available < 2 * GIB,
                Status.FAIL,
                f"only {share:.0%} of host memory available",
                action="drain",
            ),
            row(share < 0.10, Status.WARN, f"{share:.0%} of host memory available"),
            row(OTHERWISE, Status.PASS, f"{share:.0%} of host memory available"),
        ],
        value=round(available / GIB, 1),
        unit="GiB",
        expected=">= 10 %",
        details={"total_bytes": total, "available_bytes": available},
    )


def read_memory() -> CheckResult:
    import psutil

    mem = psutil.virtual_memory()
    return check_memory(int(mem.total), int(mem.available))


# -- zombie and D-state processes --------------------------------------------------------------
ZOMBIE_WARN = 20


@dataclass
class ProcState:
    pid: int
    name: str
    state: str  # the letter of /proc/PID/stat: Z zombie, D uninterruptible sleep
    ppid: int = 0
    wchan: str = ""


# Where the NVIDIA driver's own functions wait: nv*/_nv* (the kernel module's), uvm* (unified memory).
_DRIVER_WCHAN_PREFIXES = ("nv", "_nv", "uvm")


def _in_gpu_driver(p: ProcState) -> bool:
    wchan = p.wchan.lower()
    return wchan.startswith(_DRIVER_WCHAN_PREFIXES) or "nvidia" in wchan or "nvidia" in p.name.lower()


def check_process_states(zombies: list[ProcState], stuck: list[ProcState]) -> CheckResult:
    """``stuck``: processes in D state on two readings apart (not a passing I/O wait)."""
    name = "host_processes"
    details = {
        "zombies": len(zombies),
        "stuck_in_d_state": [{"pid": p.pid, "name": p.name, "wchan": p.wchan} for p in stuck[:20]],
    }
    driver_stuck = [p for p in stuck if _in_gpu_driver(p)]
    parents = sorted({p.ppid for p in zombies})[:8]
    return decide(
        name,
        [
            row(
                bool(driver_stuck),
                Status.FAIL,
                f"{len(driver_stuck)} processes stuck in the GPU driver (D state: "
                + ", ".join(f"{p.pid} {p.name} in {p.wchan or '?'}" for p in driver_stuck[:4])
                + ")",
                value=len(stuck),
                action="drain",
            ),
            row(
                bool(stuck),
                Status.WARN,
                f"{len(stuck)} processes stuck in D state (" + ", ".join(f"{p.pid} {p.name}" for p in stuck[:4]) + ")",
                value=len(stuck),
            ),
            row(
                len(zombies) >= ZOMBIE_WARN,
                Status.WARN,
                f"{len(zombies)} zombie processes (parents {parents})",
                value=len(zombies),
            ),
            row(OTHERWISE, Status.PASS, f"no stuck processes, {len(zombies)} zombies", value=0),
        ],
        details=details,
    )


def _proc_states() -> dict[int, ProcState]:
    states = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                data = fh.read().decode(errors="replace")
        except OSError:
            continue
        comm = data[data.find("(") + 1 : data.rfind(")")]
        fields = data[data.rfind(")") + 2 :].split()
        if fields and fields[0] in ("Z", "D"):
            states[int(entry.name)] = ProcState(int(entry.name), comm, fields[0], int(fields[1]))
    return states


def read_process_states(recheck_after_s: float = 0.5) -> CheckResult:
    first = _proc_states()
    if any(p.state == "D" for p in first.values()):
        time.sleep(recheck_after_s)
        second = _proc_states()
    else:
        second = first
    zombies = [p for p in second.values() if p.state == "Z"]
    stuck = [p for pid, p in second.items() if p.state == "D" and first.get(pid, p).state == "D"]
    for p in stuck:
        try:
            p.wchan = Path(f"/proc/{p.pid}/wchan").read_text().strip()
        except OSError:
            pass
    return check_process_states(zombies, stuck)


# -- InfiniBand / RoCE ports -------------------------------------------------------------------
@dataclass
class IbPort:
    device: str
    port: str
    state: str  # "4: ACTIVE"
    phys_state: str  # "5: LinkUp"
    rate: str  # "400 Gb/sec (4X NDR)"
    link_layer: str  # "InfiniBand" or "Ethernet"

    @property
    def rate_gbps(self) -> float | None:
        try:
            return float(self.rate.split()[0])
        except (ValueError, IndexError):
            return None


def check_ib_ports(ports: list[IbPort]) -> list[CheckResult]:
    """Each port must be ACTIVE and as fast as the fastest port of its link layer on the node."""
    name = "ib_ports"
    if not ports:
        return [CheckResult(name, Status.SKIPPED, "no InfiniBand / RoCE device on this node")]
    best: dict[str, float] = {}
    for p in ports:
        if p.rate_gbps is not None and "ACTIVE" in p.state:
            best[p.link_layer] = max(best.get(p.link_layer, 0.0), p.rate_gbps)
    results = []
    for p in ports:
        label = f"{p.device}/{p.port} ({p.link_layer})"
        details = {
            "device": p.device,
            "port": p.port,
            "state": p.state,
            "phys_state": p.phys_state,
            "rate": p.rate,
            "link_layer": p.link_layer,
        }
        fastest = best.get(p.link_layer, 0.0)
        results.append(
            decide(
                name,
                [
                    row(
                        "ACTIVE" not in p.state,
                        Status.WARN,
                        f"{label} is {p.state.split(':')[-1].strip()} ({p.phys_state.split(':')[-1].strip()})",
                        value=p.state,
                        expected="ACTIVE",
                    ),
                    row(
                        p.rate_gbps is not None and p.rate_gbps < fastest,
                        Status.WARN,
                        f"{label} runs at {p.rate}, slower than its peers",
                        unit="Gb/s",
                        expected=f"{fastest:g} Gb/s",
                    ),
                    row(OTHERWISE, Status.PASS, f"{label} active at {p.rate}", unit="Gb/s"),
                ],
                value=p.rate_gbps,
                details=details,
            )
        )
    return results


def read_ib_ports(root: Path = Path("/sys/class/infiniband")) -> list[CheckResult]:
    ports = []
    if root.is_dir():
        for dev in sorted(root.iterdir()):
            for port in sorted((dev / "ports").glob("*")):

                def attr(key: str, port: Path = port) -> str:
                    try:
                        return (port / key).read_text().strip()
                    except OSError:
                        return "?"

                ports.append(
                    IbPort(dev.name, port.name, attr("state"), attr("phys_state"), attr("rate"), attr("link_layer"))
                )
    return check_ib_ports(ports)
