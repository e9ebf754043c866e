"""The NVML backend (pynvml from nvidia-ml-py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from healthcheck.backends.base import NoAccelerator, XidEvent
from healthcheck.readings import DeviceProcess, DeviceReadings, NvLinkReading

T = TypeVar("T")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    name = "nvml"

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._handle_index: dict[int, int] = {}

    @classmethod
    def open(cls) -> NvmlBackend:
        try:
            import pynvml
        except ImportError:
            raise NoAccelerator("pynvml is not installed (pip install nvidia-ml-py)") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoAccelerator(f"NVML could not be initialised: {exc}") from None
        return cls(pynvml)

    def close(self) -> None:
        nv = self._nvml
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError:
                pass
            self._event_set = None
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def driver_version(self) -> str | None:
        try:
            return _text(self._nvml.nvmlSystemGetDriverVersion())
        except self._nvml.NVMLError:
            return None

    # -- readings ---------------------------------------------------------------------------
    def _get(self, r: DeviceReadings, fields: tuple[str, ...], fn: Callable[[], T]) -> T | None:
        nv = self._nvml
        try:
            return fn()
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                r.not_supported.update(fields)
            else:
                r.errors.update({f: f"NVML: {exc}" for f in fields})
            return None
        except (AttributeError, TypeError) as exc:  # a pynvml without this function
            r.errors.update({f: f"pynvml: {exc}" for f in fields})
            return None

    def read(self, index: int) -> DeviceReadings:
        nv = self._nvml
        r = DeviceReadings(index=index)
        h = nv.nvmlDeviceGetHandleByIndex(index)
        r.name = self._get(r, ("name",), lambda: _text(nv.nvmlDeviceGetName(h)))
        r.uuid = self._get(r, ("uuid",), lambda: _text(nv.nvmlDeviceGetUUID(h)))
        r.pci_bus_id = self._get(r, ("pci_bus_id",), lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId))
        r.memory_total_bytes = self._get(r, ("memory_total_bytes",), lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total))
        r.driver_version = self.driver_version()
        pm = self._get(r, ("persistence_mode",), lambda: nv.nvmlDeviceGetPersistenceMode(h))
        r.persistence_mode = None if pm is None else pm == nv.NVML_FEATURE_ENABLED
        ecc = self._get(r, ("ecc_enabled", "ecc_pending_enabled"), lambda: nv.nvmlDeviceGetEccMode(h))
        if ecc is not None:
            r.ecc_enabled = ecc[0] == nv.NVML_FEATURE_ENABLED
            r.ecc_pending_enabled = ecc[1] == nv.NVML_FEATURE_ENABLED
        if r.ecc_enabled is not False:
            unc, vol, agg = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
            r.ecc_uncorrected_volatile = self._get(
                r, ("ecc_uncorrected_volatile",), lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, unc, vol))
            )
            r.ecc_uncorrected_aggregate = self._get(
                r, ("ecc_uncorrected_aggregate",), lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, unc, agg))
            )
            r.ecc_corrected_volatile = self._get(
                r,
                ("ecc_corrected_volatile",),
                lambda: int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, vol)),
            )
        remap_fields = ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure")
        remap = self._get(r, remap_fields, lambda: nv.nvmlDeviceGetRemappedRows(h))
        if remap is not None:
            r.remapped_rows_correctable, r.remapped_rows_uncorrectable = int(remap[0]), int(remap[1])
            r.remap_pending, r.remap_failure = bool(remap[2]), bool(remap[3])
            hist = self._get(r, ("remap_banks_exhausted",), lambda: nv.nvmlDeviceGetRowRemapperHistogram(h))
            if hist is not None:
                r.remap_banks_exhausted = int(hist.none)
        else:
            causes = (
                ("retired_pages_sbe", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
                ("retired_pages_dbe", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
            )
            for fname, cause in causes:

                def retired(cause: int = cause) -> list[int]:
                    return list(nv.nvmlDeviceGetRetiredPages(h, cause))

                pages = self._get(r, (fname,), retired)
                setattr(r, fname, None if pages is None else len(pages))
            pending = self._get(r, ("retired_pages_pending",), lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
            r.retired_pages_pending = None if pending is None else pending == nv.NVML_FEATURE_ENABLED
        r.pcie_gen_current = self._get(r, ("pcie_gen_current",), lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)))
        r.pcie_gen_max = self._get(r, ("pcie_gen_max",), lambda: int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h)))
        r.pcie_width_current = self._get(r, ("pcie_width_current",), lambda: int(nv.nvmlDeviceGetCurrPcieLinkWidth(h)))
        r.pcie_width_max = self._get(r, ("pcie_width_max",), lambda: int(nv.nvmlDeviceGetMaxPcieLinkWidth(h)))
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        r.clock_event_reasons = self._get(r, ("clock_event_reasons",), lambda: int(reasons_fn(h)))
        r.sm_clock_mhz = self._get(r, ("sm_clock_mhz",), lambda: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
        r.sm_clock_max_mhz = self._get(
            r, ("sm_clock_max_mhz",), lambda: int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        )
        r.temperature_c = self._get(
            r, ("temperature_c",), lambda: int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        )
        r.temperature_slowdown_c = self._get(
            r,
            ("temperature_slowdown_c",),
            lambda: int(nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        )
        r.temperature_shutdown_c = self._get(
            r,
            ("temperature_shutdown_c",),
            lambda: int(nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)),
        )
        r.nvlinks = self._read_nvlinks(r, h)
        r.processes = self._get(r, ("processes",), lambda: self._processes(h))
        return r

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(index)
        try:
            return int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h)), int(nv.nvmlDeviceGetCurrPcieLinkWidth(h))
        except nv.NVMLError:
            return None, None

    def _read_nvlinks(self, r: DeviceReadings, h: Any) -> list[NvLinkReading] | None:
        nv = self._nvml
        links: list[NvLinkReading] = []
        counters = (
            ("replay_errors", nv.NVML_NVLINK_ERROR_DL_REPLAY),
            ("recovery_errors", nv.NVML_NVLINK_ERROR_DL_RECOVERY),
            ("crc_flit_errors", nv.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            ("crc_data_errors", nv.NVML_NVLINK_ERROR_DL_CRC_DATA),
        )
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT):
                    continue  # no such link on this device
                r.errors["nvlinks"] = f"NVML: link {link}: {exc}"
                return None
            reading = NvLinkReading(link=link, active=state == nv.NVML_FEATURE_ENABLED)
            if reading.active:
                for attr, counter in counters:
                    try:
                        setattr(reading, attr, int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter)))
                    except nv.NVMLError:
                        pass  # counters moved to field values on newer GPUs; the state is what we judge
            links.append(reading)
        if not links:
            r.not_supported.add("nvlinks")
        return links

    def _processes(self, h: Any) -> list[DeviceProcess]:
        nv = self._nvml
        seen: dict[int, DeviceProcess] = {}
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            for proc in fn(h):
                used = getattr(proc, "usedGpuMemory", None)
                seen[int(proc.pid)] = DeviceProcess(pid=int(proc.pid), used_memory_bytes=int(used) if used else None)
        return list(seen.values())

    # -- live XID events --------------------------------------------------------------------
    def watch_xid(self) -> bool:
        nv = self._nvml
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            return False
        registered = 0
        for index in range(self.device_count()):
            h = nv.nvmlDeviceGetHandleByIndex(index)
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
            except nv.NVMLError:
                continue
            registered += 1
            self._handle_index[self._handle_key(h)] = index
        if not registered:
            nv.nvmlEventSetFree(event_set)
            return False
        self._event_set = event_set
        return True

    @staticmethod
    def _handle_key(handle: Any) -> int:
        import ctypes

        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)

    def xid_events(self) -> list[XidEvent]:
        nv = self._nvml
        events: list[XidEvent] = []
        if self._event_set is None:
            return events
        while True:
            try:
                data = nv.nvmlEventSetWait(self._event_set, 0)
            except nv.NVMLError:
                break  # NVML_ERROR_TIMEOUT: nothing more pending
            device = self._handle_index.get(self._handle_key(data.device))
            events.append(XidEvent(device=device, xid=int(data.eventData)))
        return events
