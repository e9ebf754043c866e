"""One functional-check worker: runs the micro-benchmarks on one device.

Started by :mod:`healthcheck.functional.launcher` as ``python -m healthcheck.functional.worker
SPEC_JSON`` with ``LOCAL_RANK``/``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set. It
writes one JSON object a line on stdout: ``ready``, then ``start`` and ``result`` (or
``error``) for each check, then ``done``. Each check runs by its row
(:mod:`healthcheck.functional.table`). The launcher enforces each check's timeout by killing
the worker, so nothing here needs to guard against a hung device.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from healthcheck.functional.measurement import Measurement
from healthcheck.functional.table import Target, check_named, find


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


class NvmlSampler:
    """Reads the device's clocks and PCIe link through NVML while a benchmark runs."""

    def __init__(self, uuid: str | None) -> None:
        self._nv: Any = None
        self._h: Any = None
        if not uuid:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            self._nv = pynvml
        except Exception:
            self._nv = None

    def _read(self, key: str, fn: Any, *args: Any) -> dict[str, Any]:
        try:
            return {key: int(fn(self._h, *args))}
        except Exception:
            return {}

    def clocks(self) -> dict[str, Any]:
        nv = self._nv
        if nv is None:
            return {}
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        out: dict[str, Any] = {}
        out.update(self._read("sm_clock_mhz", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM))
        out.update(self._read("clock_event_reasons", reasons))
        out.update(self._read("power_mw", nv.nvmlDeviceGetPowerUsage))
        out.update(self._read("temperature_c", nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU))
        return out

    def pcie(self) -> dict[str, Any]:
        nv = self._nv
        if nv is None:
            return {}
        out: dict[str, Any] = {}
        out.update(self._read("pcie_gen_under_load", nv.nvmlDeviceGetCurrPcieLinkGeneration))
        out.update(self._read("pcie_width_under_load", nv.nvmlDeviceGetCurrPcieLinkWidth))
        return out


@contextlib.contextmanager
def exclusive(lock_path: str | None) -> Iterator[None]:
    """Hold ``lock_path`` so that host transfers of different devices do not overlap."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def device_identity(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"name": "cpu", "uuid": None}
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith("GPU-"):
        uuid = "GPU-" + uuid
    return {"name": props.name, "uuid": uuid or None, "memory_total_bytes": int(props.total_memory)}


def run_check(
    check: str, device: torch.device, params: dict[str, Any], sampler: NvmlSampler, lock_path: str | None
) -> list[Measurement]:
    """Run ``check`` by its row (a name no row has is a ``ValueError``)."""
    return check_named(check).run(Target(device, sampler), params)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec.get("device_type", "cuda") == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device = torch.device("cpu")
    identity = device_identity(device)
    emit("ready", pid=os.getpid(), local_rank=local_rank, **identity)
    sampler = NvmlSampler(identity.get("uuid"))
    for check in spec["checks"]:
        params = dict(spec.get("params", {}).get(check, {}))
        row = find(check)
        lock = spec.get("transfer_lock") if row is not None and row.one_at_a_time else None
        with exclusive(lock):
            emit("start", check=check)
            try:
                measurements = run_check(check, device, params, sampler, lock)
            except Exception as exc:
                emit("error", check=check, message=f"{type(exc).__name__}: {exc}")
                continue
        for m in measurements:
            emit("result", check=check, measurement=asdict(m))
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
