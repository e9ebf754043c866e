"""healthcheck.backends.nvml over a fake pynvml (the real module's constants and errors; each
device function given by the test, any other answers NOT_SUPPORTED): what is read, and that a
reading that fails is recorded as not supported or as an error, never raised or guessed."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pynvml
import pytest

from healthcheck.backends.base import NoAccelerator, XidEvent
from healthcheck.backends.nvml import NvmlBackend

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
ENABLED, DISABLED = pynvml.NVML_FEATURE_ENABLED, pynvml.NVML_FEATURE_DISABLED
GIB = 1024**3


def nvml_error(code: int = pynvml.NVML_ERROR_UNKNOWN) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def field(ret: int = pynvml.NVML_SUCCESS, value: Any = 0, value_type: int = 1) -> SimpleNamespace:
    return SimpleNamespace(fieldId=0, nvmlReturn=ret, valueType=value_type, value=SimpleNamespace(uiVal=value))


class FakeNvml:
    """pynvml's constants and errors; ``calls`` maps a function name to what it does (a value,
    an exception to raise, or a callable); functions not given answer NOT_SUPPORTED; names in
    ``missing`` are absent from this pynvml."""

    def __init__(self, missing: set[str] | None = None, **calls: Any) -> None:
        self.calls = {"nvmlDeviceGetHandleByIndex": lambda i: 100 + i, "nvmlDeviceGetCount": 1, **calls}
        self.missing = missing or set()
        self.log: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in self.missing:
            raise AttributeError(name)
        if not name.startswith("nvml") or name.startswith("nvmlEventType"):
            return getattr(pynvml, name)
        how = self.calls.get(name)

        def call(*args: Any) -> Any:
            self.log.append(name)
            if how is None:
                raise nvml_error(NOT_SUPPORTED)
            if isinstance(how, BaseException):
                raise how
            return how(*args) if callable(how) else how

        return call


def read(**calls: Any):
    return NvmlBackend(FakeNvml(**calls)).read(0)


# -- opening ----------------------------------------------------------------------------------
def test_without_pynvml_the_backend_says_how_to_install_it():
    with mock.patch.dict(sys.modules, {"pynvml": None}):
        with pytest.raises(NoAccelerator, match=r"pip install nvidia-ml-py"):
            NvmlBackend.open()


def test_an_nvml_that_cannot_initialise_is_no_accelerator(monkeypatch):
    def fail():
        raise nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(NoAccelerator, match="NVML could not be initialised"):
        NvmlBackend.open()


# -- readings ---------------------------------------------------------------------------------
def test_identity_memory_and_modes_are_read():
    r = read(
        nvmlDeviceGetName=b"NVIDIA H200",
        nvmlDeviceGetUUID="GPU-abc",
        nvmlDeviceGetPciInfo=SimpleNamespace(busId=b"00000000:18:00.0"),
        nvmlDeviceGetMemoryInfo=SimpleNamespace(total=141 * GIB),
        nvmlSystemGetDriverVersion=b"570.86",
        nvmlDeviceGetPersistenceMode=ENABLED,
        nvmlDeviceGetEccMode=(ENABLED, DISABLED),
        nvmlDeviceGetTotalEccErrors=lambda h, kind, where: 3 if where == pynvml.NVML_VOLATILE_ECC else 7,
    )
    assert (r.name, r.uuid, r.pci_bus_id, r.driver_version) == ("NVIDIA H200", "GPU-abc", "00000000:18:00.0", "570.86")
    assert (r.memory_total_bytes, r.persistence_mode) == (141 * GIB, True)
    assert (r.ecc_enabled, r.ecc_pending_enabled) == (True, False)
    assert (r.ecc_uncorrected_volatile, r.ecc_uncorrected_aggregate, r.ecc_corrected_volatile) == (3, 7, 3)


def test_ecc_counters_are_not_read_when_ecc_is_off():
    backend_nvml = FakeNvml(nvmlDeviceGetEccMode=(DISABLED, DISABLED), nvmlDeviceGetTotalEccErrors=1)
    r = NvmlBackend(backend_nvml).read(0)
    assert r.ecc_enabled is False and r.ecc_uncorrected_volatile is None
    assert "nvmlDeviceGetTotalEccErrors" not in backend_nvml.log


def test_not_supported_is_recorded_apart_from_an_error():
    r = read(nvmlDeviceGetTemperature=nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert "temperature_c" in r.errors and r.errors["temperature_c"].startswith("NVML: ")
    assert "persistence_mode" in r.not_supported and "persistence_mode" not in r.errors
    assert r.temperature_c is None


def test_a_function_this_pynvml_lacks_is_an_error_naming_pynvml():
    r = NvmlBackend(FakeNvml(missing={"nvmlDeviceGetMaxClockInfo"})).read(0)
    assert r.errors["sm_clock_max_mhz"].startswith("pynvml: ")


def test_row_remapping_replaces_retired_pages():
    nv = FakeNvml(
        nvmlDeviceGetRemappedRows=(2, 1, 1, 0),
        nvmlDeviceGetRowRemapperHistogram=SimpleNamespace(none=3),
        nvmlDeviceGetRetiredPages=[1, 2],
    )
    r = NvmlBackend(nv).read(0)
    assert (r.remapped_rows_correctable, r.remapped_rows_uncorrectable, r.remap_pending, r.remap_failure) == (
        2,
        1,
        True,
        False,
    )
    assert r.remap_banks_exhausted == 3
    assert r.retired_pages_sbe is None and "nvmlDeviceGetRetiredPages" not in nv.log


def test_without_row_remapping_retired_pages_are_counted_by_cause():
    r = read(
        nvmlDeviceGetRetiredPages=lambda h, cause: (
            [1] * (5 if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS else 2)
        ),
        nvmlDeviceGetRetiredPagesPendingStatus=ENABLED,
    )
    assert (r.retired_pages_sbe, r.retired_pages_dbe, r.retired_pages_pending) == (5, 2, True)


def test_clock_reasons_fall_back_to_the_older_throttle_call():
    r = NvmlBackend(
        FakeNvml(missing={"nvmlDeviceGetCurrentClocksEventReasons"}, nvmlDeviceGetCurrentClocksThrottleReasons=0x40)
    ).read(0)
    assert r.clock_event_reasons == 0x40


def test_processes_of_both_kinds_are_listed_once_per_pid():
    compute = [SimpleNamespace(pid=10, usedGpuMemory=GIB), SimpleNamespace(pid=11, usedGpuMemory=None)]
    graphics = [SimpleNamespace(pid=10, usedGpuMemory=GIB)]
    r = read(nvmlDeviceGetComputeRunningProcesses=compute, nvmlDeviceGetGraphicsRunningProcesses=graphics)
    assert sorted((p.pid, p.used_memory_bytes) for p in r.processes) == [(10, GIB), (11, None)]


# -- counters and field values ----------------------------------------------------------------
def fields_of(values: dict[str, SimpleNamespace]):
    by_id = {getattr(pynvml, name): v for name, v in values.items()}
    return lambda h, ids: [by_id.get(fid, field(NOT_SUPPORTED)) for fid, _ in ids]


def test_recovery_fields_and_the_replay_counter_are_read():
    r = read(
        nvmlDeviceGetPcieReplayCounter=12,
        nvmlDeviceGetFieldValues=fields_of(
            {
                "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": field(value=2),
                "NVML_FI_DEV_RESET_STATUS": field(value=0),
                "NVML_FI_DEV_DRAIN_AND_RESET_STATUS": field(value=1),
            }
        ),
    )
    assert (r.pcie_replay_count, r.recovery_action, r.reset_required, r.drain_and_reset_recommended) == (
        12,
        2,
        False,
        True,
    )


def test_field_value_answers_are_sorted_into_not_supported_and_errors():
    r = read(
        nvmlDeviceGetFieldValues=fields_of(
            {
                "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": field(pynvml.NVML_ERROR_INVALID_ARGUMENT),
                "NVML_FI_DEV_RESET_STATUS": field(pynvml.NVML_ERROR_UNKNOWN),
                "NVML_FI_DEV_DRAIN_AND_RESET_STATUS": field(value_type=99),
            }
        ),
    )
    # a field id the driver does not know is not supported; an error or an odd type is an error
    assert "recovery_action" in r.not_supported and r.recovery_action is None
    assert "returned error" in r.errors["reset_required"]
    assert "unknown type 99" in r.errors["drain_and_reset_recommended"]


def test_a_pynvml_without_a_field_constant_never_guesses_its_number():
    nv = FakeNvml(missing={"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"}, nvmlDeviceGetFieldValues=lambda h, ids: [])
    r = NvmlBackend(nv).read_counters(0)
    assert "this pynvml has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" in r.errors["recovery_action"]


def test_read_counters_reads_only_what_may_change():
    nv = FakeNvml(nvmlDeviceGetPcieReplayCounter=4, nvmlDeviceGetName="x")
    r = NvmlBackend(nv).read_counters(0)
    assert r.pcie_replay_count == 4 and r.name is None
    assert "nvmlDeviceGetName" not in nv.log


# -- NVLink -----------------------------------------------------------------------------------
def link_state(active: dict[int, bool]):
    def state(h, link):
        if link not in active:
            raise nvml_error(NOT_SUPPORTED)
        return ENABLED if active[link] else DISABLED

    return state


def test_a_device_without_nvlink_has_no_links_and_says_not_supported():
    r = read()
    assert r.nvlinks == [] and "nvlinks" in r.not_supported


def test_a_failing_link_state_leaves_the_links_unread_with_the_error():
    r = read(nvmlDeviceGetNvLinkState=nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert r.nvlinks is None and r.errors["nvlinks"].startswith("NVML: link 0:")


def test_active_links_have_their_error_counters_read():
    r = read(
        nvmlDeviceGetNvLinkState=link_state({0: True, 1: False}),
        nvmlDeviceGetNvLinkErrorCounter=lambda h, link, counter: 10 * link + counter,
    )
    assert [(x.link, x.active) for x in r.nvlinks] == [(0, True), (1, False)]
    assert r.nvlinks[0].counters() == {
        "replay_errors": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
        "recovery_errors": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
        "crc_flit_errors": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        "crc_data_errors": pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    }
    assert r.nvlinks[1].counters() == {}, "an inactive link's counters are not read"


def test_counters_come_from_field_values_where_the_counter_call_is_not_supported():
    def values(h, ids):
        return [field(value=100 + scope) for _, scope in ids]

    r = read(nvmlDeviceGetNvLinkState=link_state({0: True, 2: True}), nvmlDeviceGetFieldValues=values)
    assert r.nvlinks[1].link == 2
    assert r.nvlinks[1].counters() == {"replay_errors": 102, "recovery_errors": 102, "crc_flit_errors": 102}


def test_counters_readable_nowhere_are_not_supported():
    r = read(nvmlDeviceGetNvLinkState=link_state({0: True}))
    assert "nvlink_counters" in r.not_supported


def test_counters_that_fail_are_an_error_naming_the_links():
    r = read(
        nvmlDeviceGetNvLinkState=link_state({0: True}),
        nvmlDeviceGetNvLinkErrorCounter=nvml_error(pynvml.NVML_ERROR_UNKNOWN),
    )
    assert r.errors["nvlink_counters"].startswith("links [0]: ")


# -- the rest of the interface ----------------------------------------------------------------
def test_read_pcie_gives_generation_and_width_or_nothing():
    ok = NvmlBackend(FakeNvml(nvmlDeviceGetCurrPcieLinkGeneration=5, nvmlDeviceGetCurrPcieLinkWidth=16))
    assert ok.read_pcie(0) == (5, 16)
    assert NvmlBackend(FakeNvml()).read_pcie(0) == (None, None)


def test_driver_version_is_none_when_nvml_cannot_say():
    assert NvmlBackend(FakeNvml()).driver_version() is None
    assert NvmlBackend(FakeNvml(nvmlDeviceGetCount=3)).device_count() == 3


def test_the_call_a_thread_is_in_is_named():
    seen: list[str | None] = []
    backend: NvmlBackend

    def name(h):
        seen.append(backend.call_in_flight(threading.get_ident()))
        return "x"

    backend = NvmlBackend(FakeNvml(nvmlDeviceGetName=name))
    backend.read(0)
    assert seen == ["NVML call nvmlDeviceGetName"]
    assert backend.call_in_flight(threading.get_ident()) is None


def test_live_xids_are_given_by_device():
    # GIVEN two devices, both registered, and one XID 79 pending on the second
    pending = [SimpleNamespace(device=101, eventData=79)]

    def wait(event_set, timeout_ms):
        if not pending:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return pending.pop()

    nv = FakeNvml(
        nvmlDeviceGetCount=2,
        nvmlEventSetCreate="set",
        nvmlDeviceRegisterEvents=lambda h, kind, event_set: None,
        nvmlEventSetWait=wait,
        nvmlEventSetFree=lambda event_set: None,
        nvmlShutdown=lambda: None,
    )
    backend = NvmlBackend(nv)
    # WHEN watched and read
    assert backend.watch_xid() is True
    events = backend.xid_events()
    # THEN the event is the second device's; nothing more is pending; close frees the set
    assert events == [XidEvent(device=1, xid=79)]
    assert backend.xid_events() == []
    backend.close()
    assert "nvmlEventSetFree" in nv.log and "nvmlShutdown" in nv.log


def test_no_xid_watch_when_no_device_registers():
    nv = FakeNvml(nvmlEventSetCreate="set", nvmlEventSetFree=lambda s: None)
    backend = NvmlBackend(nv)
    assert backend.watch_xid() is False
    assert "nvmlEventSetFree" in nv.log
    assert backend.xid_events() == []


def test_close_swallows_nvml_errors():
    nv = FakeNvml(nvmlShutdown=nvml_error(pynvml.NVML_ERROR_UNINITIALIZED))
    NvmlBackend(nv).close()  # must not raise
    assert "nvmlShutdown" in nv.log
