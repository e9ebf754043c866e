"""The NVML backend (pynvml from nvidia-ml-py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from healthcheck.backends.base import NoAccelerator, XidEvent
from healthcheck.readings import DeviceProcess, DeviceReadings, NvLinkReading
from healthcheck.timeouts import InFlight

T = TypeVar("T")

# NVML field value types (nvmlValueType_t) -> the member of the value union that holds it.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# Field ids read through nvmlDeviceGetFieldValues, by the pynvml constant that names them (a
# pynvml without the constant cannot read the field: it is never given as a bare number).
RECOVERY_FIELDS = (
    ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
    ("reset_required", "NVML_FI_DEV_RESET_STATUS"),
    ("drain_and_reset_recommended", "NVML_FI_DEV_DRAIN_AND_RESET_STATUS"),
)
# NVLink error counters as field values (scope: the link), for GPUs whose
# nvmlDeviceGetNvLinkErrorCounter answers NOT_SUPPORTED.
NVLINK_FIELDS = (
    ("replay_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY"),
    ("recovery_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit_errors", "NVML_FI_DEV_NVLINK_ERROR_DL_CRC"),
)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _TracedNvml:
    """The pynvml module, with each ``nvml*`` function call recorded in :class:`InFlight`."""

    def __init__(self, module: Any, in_flight: InFlight) -> None:
        self._module = module
        self._in_flight = in_flight

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not name.startswith("nvml") or isinstance(value, type) or not callable(value):
            return value
        in_flight = self._in_flight

        def traced(*args: Any, **kwargs: Any) -> Any:
            in_flight.enter(name)
            try:
                return value(*args, **kwargs)
            finally:
                in_flight.leave()

        return traced


class NvmlBackend:
    name = "nvml"

    def __init__(self, nvml: Any) -> None:
        self.in_flight = InFlight()
        self._nvml = _TracedNvml(nvml, self.in_flight)
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

    def call_in_flight(self, thread_id: int | None) -> str | None:
        """The NVML call thread ``thread_id`` is in now (to name a call that did not return)."""
        name = self.in_flight.of(thread_id)
        return f"NVML call {name}" if name else None

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
        self._read_counters(r, h)
        return r

    def read_counters(self, index: int) -> DeviceReadings:
        """What may change during the check: the PCIe replay counter, the recovery action and
        the NVLink error counters (read again at the end, for their deltas)."""
        nv = self._nvml
        r = DeviceReadings(index=index)
        h = nv.nvmlDeviceGetHandleByIndex(index)
        r.nvlinks = self._read_nvlinks(r, h)
        self._read_counters(r, h)
        return r

    def _read_counters(self, r: DeviceReadings, h: Any) -> None:
        nv = self._nvml
        r.pcie_replay_count = self._get(r, ("pcie_replay_count",), lambda: int(nv.nvmlDeviceGetPcieReplayCounter(h)))
        values = self._field_values(r, h, [(attr, constant, 0) for attr, constant in RECOVERY_FIELDS])
        action = values.get("recovery_action")
        r.recovery_action = None if action is None else int(action)
        for attr in ("reset_required", "drain_and_reset_recommended"):
            value = values.get(attr)
            setattr(r, attr, None if value is None else bool(value))

    def _field_values(self, r: DeviceReadings, h: Any, wanted: list[tuple[str, str, int]]) -> dict[str, int | float]:
        """``{field: value}`` of ``(field, pynvml constant, scope id)`` through one
        nvmlDeviceGetFieldValues call; a field that is not read is recorded in ``r``."""
        nv = self._nvml
        ids: list[tuple[int, int]] = []
        names: list[str] = []
        for attr, constant, scope in wanted:
            field_id = getattr(nv, constant, None)
            if field_id is None:
                r.errors[attr] = f"this pynvml has no {constant} (pip install -U nvidia-ml-py)"
                continue
            ids.append((int(field_id), scope))
            names.append(attr)
        if not ids:
            return {}
        got = self._get(r, tuple(names), lambda: list(nv.nvmlDeviceGetFieldValues(h, ids)))
        out: dict[str, int | float] = {}
        for attr, value in zip(names, got or [], strict=False):
            ret = int(getattr(value, "nvmlReturn", -1))
            if ret == nv.NVML_SUCCESS:
                member = _VALUE_MEMBER.get(int(value.valueType))
                if member is None:
                    r.errors[attr] = f"NVML: field value of unknown type {int(value.valueType)}"
                    continue
                out[attr] = getattr(value.value, member)
            elif ret in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_INVALID_ARGUMENT):
                # INVALID_ARGUMENT: a field id this driver does not know (older than this pynvml).
                r.not_supported.add(attr)
            else:
                r.errors[attr] = f"NVML: field {value.fieldId} returned error {ret}"
        return out

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
        counter_error: str | None = None
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
                    except nv.NVMLError as exc:
                        if getattr(exc, "value", None) != nv.NVML_ERROR_NOT_SUPPORTED:
                            counter_error = f"NVML: link {link}: {exc}"
            links.append(reading)
        if not links:
            r.not_supported.add("nvlinks")
            return links
        unread = [link for link in links if link.active and not link.counters()]
        if unread:
            # Newer GPUs give the counters as field values, one scope per link.
            probe = DeviceReadings(index=r.index)
            wanted = [
                (f"{attr}:{link.link}", constant, link.link) for link in unread for attr, constant in NVLINK_FIELDS
            ]
            values = self._field_values(probe, h, wanted)
            for key, value in values.items():
                attr, link_no = key.split(":")
                setattr(links[[x.link for x in links].index(int(link_no))], attr, int(value))
            still = [link.link for link in unread if not link.counters()]
            if still:
                errors = sorted({probe.errors[k] for k in probe.errors} | ({counter_error} if counter_error else set()))
                if errors:
                    r.errors["nvlink_counters"] = f"links {still}: " + "; ".join(errors[:3])
                else:
                    r.not_supported.add("nvlink_counters")
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
