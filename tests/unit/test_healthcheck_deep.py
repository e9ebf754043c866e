"""The deeper, fail-closed probes: recovery action, counter deltas, probes that hang.

The NVML backend runs over a fake pynvml module (the real module's constants and exceptions,
with the device functions given by each test); the runner over a fake backend; InfiniBand
over a fake sysfs tree in tmp_path; shared filesystems over real child processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from healthcheck import runner as runner_mod
from healthcheck.backends.base import XidEvent
from healthcheck.backends.nvml import NvmlBackend
from healthcheck.checks.counters import check_nvlink_errors, check_pcie_replay, check_recovery_action
from healthcheck.options import Options
from healthcheck.readings import DeviceReadings, NvLinkReading
from healthcheck.result import Status
from healthcheck.timeouts import InFlight
from tests.support.readings import healthy_readings

ROOT = Path(__file__).resolve().parents[2]
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


# -- a fake pynvml --------------------------------------------------------------------------
def field(ret: int = pynvml.NVML_SUCCESS, value: int = 0, field_id: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        fieldId=field_id,
        nvmlReturn=ret,
        valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        value=SimpleNamespace(uiVal=value),
    )


class FakeNvml:
    """pynvml's constants and errors; device functions that are not defined answer NOT_SUPPORTED.

    ``fields``: ``{(field id, scope): (nvmlReturn, value)}``, a value may be a list (one per read);
    ``replay``: the PCIe replay counter's successive values; ``hang``: the names of calls that
    block until ``release`` is set; ``missing``: pynvml constants this pynvml lacks."""

    def __init__(
        self,
        fields: dict[tuple[int, int], tuple[int, Any]] | None = None,
        replay: list[int] | None = None,
        links: int = 0,
        link_counters: dict[tuple[int, int], list[int]] | None = None,
        hang: dict[str, int] | None = None,
        missing: set[str] | None = None,
    ) -> None:
        self._fields = fields or {}
        self._replay = replay if replay is not None else [0]
        self._links = links
        self._link_counters = link_counters
        self._hang = hang or {}
        self._missing = missing or set()
        self._reads: dict[Any, int] = {}
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVML") or name.startswith("nvmlEventType"):
            if name in self._missing:
                raise AttributeError(name)
            return getattr(pynvml, name)
        if name.startswith("nvml"):

            def not_supported(*args: Any, **kwargs: Any) -> Any:
                raise pynvml.NVMLError(NOT_SUPPORTED)

            return not_supported
        raise AttributeError(name)

    def _next(self, key: Any, values: list[int]) -> int:
        n = self._reads.get(key, 0)
        self._reads[key] = n + 1
        return values[min(n, len(values) - 1)]

    def _maybe_hang(self, name: str) -> None:
        calls = self._reads.get(name, 0)
        self._reads[name] = calls + 1
        if name in self._hang and calls + 1 >= self._hang[name]:
            self.release.wait()

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Fake GPU"

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        self._maybe_hang("nvmlDeviceGetPcieReplayCounter")
        return self._next("replay", self._replay)

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[tuple[int, int]]) -> list[SimpleNamespace]:
        out = []
        for fid, scope in ids:
            ret, value = self._fields.get((fid, scope), (NOT_SUPPORTED, 0))
            if isinstance(value, list):
                value = self._next((fid, scope), value)
            out.append(field(ret, value, fid))
        return out

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self._links:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        if self._link_counters is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return self._next((link, counter), self._link_counters.get((link, counter), [0]))


RECOVERY = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
RESET_STATUS = pynvml.NVML_FI_DEV_RESET_STATUS
DRAIN_AND_RESET = pynvml.NVML_FI_DEV_DRAIN_AND_RESET_STATUS
OK = pynvml.NVML_SUCCESS


def read_twice(nvml: FakeNvml) -> tuple[DeviceReadings, DeviceReadings]:
    backend = NvmlBackend(nvml)
    return backend.read(0), backend.read_counters(0)


# -- recovery action --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("action", "status", "act"),
    [(0, Status.PASS, None), (1, Status.FAIL, "reset"), (2, Status.FAIL, "drain"), (4, Status.FAIL, "drain")],
)
def test_the_drivers_recovery_action_decides(action, status, act):
    # GIVEN NVML's recovery-action field
    start, end = read_twice(FakeNvml(fields={(RECOVERY, 0): (OK, action)}))
    # WHEN judged over the run
    result = check_recovery_action(start, "nvml", end)
    # THEN "none" passes and any action fails with what the scheduler must do
    assert start.recovery_action == action
    assert (result.status, result.action) == (status, act), result


def test_a_recovery_action_that_appears_during_the_run_fails():
    # GIVEN none at the start, a GPU reset asked for at the end
    start, end = read_twice(FakeNvml(fields={(RECOVERY, 0): (OK, [0, 1])}))
    # WHEN judged
    result = check_recovery_action(start, "nvml", end)
    # THEN the node fails: the device needs a reset
    assert (result.status, result.action) == (Status.FAIL, "reset")
    assert result.details["readings"] == [0, 1]


def test_older_drivers_reset_status_fields_are_used_when_the_recovery_action_is_not_supported():
    # GIVEN a driver without the recovery-action field, whose reset status says reset required
    start, end = read_twice(FakeNvml(fields={(RESET_STATUS, 0): (OK, 1), (DRAIN_AND_RESET, 0): (OK, 0)}))
    # WHEN judged
    result = check_recovery_action(start, "nvml", end)
    # THEN the reset status decides
    assert start.recovery_action is None and "recovery_action" in start.not_supported
    assert (result.status, result.action) == (Status.FAIL, "reset")


def test_recovery_fields_not_supported_anywhere_are_skipped_never_passed():
    start, end = read_twice(FakeNvml())
    assert check_recovery_action(start, "nvml", end).status is Status.SKIPPED


def test_a_pynvml_without_the_field_constant_is_unknown_never_a_guessed_id():
    # GIVEN a pynvml that has no recovery-action constant (and a driver without the older fields)
    start, end = read_twice(FakeNvml(missing={"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"}))
    # WHEN judged
    result = check_recovery_action(start, "nvml", end)
    # THEN it is unknown and names the missing constant
    assert result.status is Status.UNKNOWN
    assert "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" in result.reason


def test_a_field_that_answers_an_error_is_unknown():
    start, end = read_twice(FakeNvml(fields={(RECOVERY, 0): (pynvml.NVML_ERROR_UNKNOWN, 0)}))
    result = check_recovery_action(start, "nvml", end)
    assert result.status is Status.UNKNOWN and "returned error" in result.reason


def test_recovery_action_none_at_the_start_and_no_end_reading_is_unknown():
    start, _ = read_twice(FakeNvml(fields={(RECOVERY, 0): (OK, 0)}))
    result = check_recovery_action(start, "nvml", None, "NVML call x did not return in 10 s")
    assert result.status is Status.UNKNOWN and "did not return" in result.reason
    # AND an end reading without the field is no better
    end = DeviceReadings(0, errors={"recovery_action": "NVML: Unknown Error"})
    result = check_recovery_action(start, "nvml", end)
    assert result.status is Status.UNKNOWN and "Unknown Error" in result.reason


# -- PCIe replays ----------------------------------------------------------------------------
@pytest.mark.parametrize(("values", "status"), [([7, 7], Status.PASS), ([7, 9], Status.FAIL), ([7, 0], Status.UNKNOWN)])
def test_pcie_replays_during_the_run_fail_a_steady_total_passes(values, status):
    # GIVEN the replay counter at the start and at the end of the run
    start, end = read_twice(FakeNvml(replay=values))
    # WHEN judged on its difference
    result = check_pcie_replay(start, "nvml", end, 0.4)
    # THEN replays during the run fail (drain); a steady total passes; going backwards is unknown
    assert result.status is status, result
    if status is Status.FAIL:
        assert result.value == 2 and result.action == "drain"
    assert result.details.get("start", 7) == 7


def test_pcie_replay_counter_not_supported_is_skipped_and_an_error_is_unknown():
    r = DeviceReadings(index=0, not_supported={"pcie_replay_count"})
    assert check_pcie_replay(r, "nvml", r, 1.0).status is Status.SKIPPED
    r = DeviceReadings(index=0, errors={"pcie_replay_count": "NVML: Unknown Error"})
    result = check_pcie_replay(r, "nvml", r, 1.0)
    assert result.status is Status.UNKNOWN and "Unknown Error" in result.reason


# -- NVLink error deltas ----------------------------------------------------------------------
def test_nvlink_counters_that_rise_during_the_run_fail_and_steady_ones_pass():
    # GIVEN two active links; link 1's replay counter rises between the two readings
    replay = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
    rising = FakeNvml(links=2, link_counters={(0, replay): [3, 3], (1, replay): [5, 8]})
    steady = FakeNvml(links=2, link_counters={(0, replay): [3, 3], (1, replay): [5, 5]})
    # WHEN each is judged over the run
    bad_start, bad_end = read_twice(rising)
    bad = check_nvlink_errors(bad_start, "nvml", bad_end, 1.0)
    good_start, good_end = read_twice(steady)
    good = check_nvlink_errors(good_start, "nvml", good_end, 1.0)
    # THEN the rising one fails (reset) naming the link; the steady one passes, with its totals
    assert (bad.status, bad.action) == (Status.FAIL, "reset"), bad
    assert "link 1 replay +3" in bad.reason
    assert good.status is Status.PASS and good.details["totals_at_start"]["replay_errors"] == 8


def test_nvlink_counters_from_field_values_where_the_error_counter_call_is_not_supported():
    # GIVEN a GPU that gives its NVLink counters only as field values (scope: the link)
    crc = pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC
    fields = {(pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 0): (OK, 0), (crc, 0): (OK, [1, 4])}
    start, end = read_twice(FakeNvml(links=1, fields=fields))
    # WHEN judged
    result = check_nvlink_errors(start, "nvml", end, 1.0)
    # THEN the field values were read and their rise fails
    assert start.nvlinks is not None and start.nvlinks[0].crc_flit_errors == 1
    assert result.status is Status.FAIL and "crc_flit +3" in result.reason


def test_nvlink_counters_not_readable_are_skipped_or_unknown_never_pass():
    # GIVEN active links whose counters NVML supports in neither way
    start, end = read_twice(FakeNvml(links=2))
    assert check_nvlink_errors(start, "nvml", end, 1.0).status is Status.SKIPPED
    # GIVEN a counter that failed to read
    r = DeviceReadings(index=0, nvlinks=[NvLinkReading(0, True)], errors={"nvlink_counters": "NVML: link 0: Unknown"})
    assert check_nvlink_errors(r, "nvml", r, 1.0).status is Status.UNKNOWN
    # GIVEN no NVLink at all
    assert check_nvlink_errors(DeviceReadings(0, not_supported={"nvlinks"}), "nvml", None, 1.0).status is Status.SKIPPED
    # GIVEN counters read at the start but not at the end
    r = DeviceReadings(index=0, nvlinks=[NvLinkReading(0, True, 0, 0, 0, 0)])
    assert check_nvlink_errors(r, "nvml", DeviceReadings(0, nvlinks=[]), 1.0).status is Status.UNKNOWN
    assert check_nvlink_errors(r, "nvml", None, 1.0, "did not return").status is Status.UNKNOWN


# -- a runner over a fake backend -------------------------------------------------------------
def healthy(index: int, **fields: Any) -> DeviceReadings:
    return healthy_readings(index, links=2, **fields)


class FakeBackend:
    """Start readings, end readings, and calls that may block (until ``release``)."""

    name = "fake"

    def __init__(
        self,
        start: list[DeviceReadings],
        end: list[DeviceReadings] | None = None,
        hang_read: set[int] | None = None,
        on_end: Any = None,
    ) -> None:
        self.start, self.end = start, end or start
        self.hang_read = hang_read or set()
        self.on_end = on_end
        self.release = threading.Event()
        self.in_flight = InFlight()

    def device_count(self) -> int:
        return len(self.start)

    def driver_version(self) -> str | None:
        return "999.1"

    def call_in_flight(self, thread_id: int | None) -> str | None:
        name = self.in_flight.of(thread_id)
        return f"fake call {name}" if name else None

    def read(self, index: int) -> DeviceReadings:
        if index in self.hang_read:
            self.in_flight.enter("fakeDeviceRead")
            self.release.wait()
        return self.start[index]

    def read_counters(self, index: int) -> DeviceReadings:
        if self.on_end is not None:
            self.on_end()
        return self.end[index]

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        return 5, 16

    def watch_xid(self) -> bool:
        return True

    def xid_events(self) -> list[XidEvent]:
        return []

    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch):
    backends: list[FakeBackend] = []

    def put(backend: Any) -> Any:
        backends.append(backend)
        monkeypatch.setattr(runner_mod, "open_backend", lambda kind, tool: backend)
        monkeypatch.setattr(runner_mod.xidlog, "read_kernel_log_xids", lambda window, now=None: ([], "test log"))
        return backend

    yield put
    for b in backends:
        b.release.set()


def quick(tmp_path: Path, **options: Any) -> Any:
    defaults: dict[str, Any] = dict(
        level="quick", disk_paths=["/"], min_disk_gib=0.001, ib_root=str(tmp_path / "no-ib"), shared_fs=[]
    )
    return runner_mod.run(Options(**{**defaults, **options}))


def by_name(report: Any, name: str) -> list[Any]:
    return [c for c in report.checks if c.name == name]


def test_a_device_read_that_never_returns_is_unknown_naming_the_call_and_the_run_finishes(install, tmp_path):
    # GIVEN two devices; reading device 1 blocks forever
    backend = install(FakeBackend([healthy(0), healthy(1)], hang_read={1}))

    # WHEN the quick level runs with a 0.5 s probe limit
    report = quick(tmp_path, probe_timeout_s=0.5)

    # THEN device 1 is unknown with the call named, device 0 was judged, and the run returned: exit 3
    (read,) = by_name(report, "device_read")
    assert read.device == 1 and read.status is Status.UNKNOWN and read.critical
    assert "fake call fakeDeviceRead did not return in 0.5 s" in read.reason
    assert {c.device for c in by_name(report, "pcie_replay")} == {0}
    assert report.exit_code == 3
    # AND the hung driver is not asked for what can wait: XID events unread, no shutdown
    (live,) = by_name(report, "xid_live")
    assert live.status is Status.UNKNOWN and "earlier driver call did not return" in live.reason
    assert backend.closed is False


def quick_with_replay_counter_hanging(install, tmp_path, from_call: int):
    """The quick level's report over NVML whose PCIe replay counter call blocks forever from its
    ``from_call``-th call (1: at the start; 2: at the end of the check)."""
    nvml = FakeNvml(fields={(RECOVERY, 0): (OK, 0)}, hang={"nvmlDeviceGetPcieReplayCounter": from_call})
    backend = NvmlBackend(nvml)
    backend.release = nvml.release  # type: ignore[attr-defined]
    install(backend)
    return quick(tmp_path, probe_timeout_s=0.5)


def test_an_nvml_call_that_never_returns_is_named(install, tmp_path):
    # GIVEN NVML whose PCIe replay counter call blocks forever
    # WHEN the quick level runs
    report = quick_with_replay_counter_hanging(install, tmp_path, from_call=1)

    # THEN the device is unknown and the reason names the NVML call that did not return
    (read,) = by_name(report, "device_read")
    assert read.reason == "NVML call nvmlDeviceGetPcieReplayCounter did not return in 0.5 s (driver hung?)"
    assert report.exit_code == 3
    assert not [c for c in report.checks if c.device == 0 and c.status is Status.PASS]


def test_an_nvml_call_that_hangs_at_the_end_makes_the_counter_checks_unknown(install, tmp_path):
    # GIVEN NVML whose replay counter answers at the start and blocks at the end
    # WHEN the quick level runs
    report = quick_with_replay_counter_hanging(install, tmp_path, from_call=2)

    # THEN the counter checks are unknown, naming the call; none passes
    for name in ("recovery_action", "pcie_replay"):
        (c,) = by_name(report, name)
        assert c.status is Status.UNKNOWN, c
        assert "NVML call nvmlDeviceGetPcieReplayCounter did not return in 0.5 s" in c.reason


def test_counters_that_rise_during_the_run_fail_and_steady_ones_pass(install, tmp_path):
    # GIVEN device 0 steady, device 1 whose PCIe replays and NVLink recoveries rise during the run
    end1 = healthy(
        1, pcie_replay_count=4, nvlinks=[NvLinkReading(0, True, 0, 2, 0, 0), NvLinkReading(1, True, 0, 0, 0, 0)]
    )
    install(FakeBackend([healthy(0), healthy(1)], end=[healthy(0), end1]))

    # WHEN the quick level runs
    report = quick(tmp_path)

    # THEN device 1 fails both checks, device 0 passes them
    replay = {c.device: c for c in by_name(report, "pcie_replay")}
    nvlink = {c.device: c for c in by_name(report, "nvlink_errors")}
    assert replay[0].status is Status.PASS and nvlink[0].status is Status.PASS
    assert replay[1].status is Status.FAIL and replay[1].value == 4
    assert nvlink[1].status is Status.FAIL and "link 0 recovery +2" in nvlink[1].reason
    assert {c.status for c in by_name(report, "recovery_action")} == {Status.PASS}
    assert report.exit_code == 2 and report.device_actions()["1"] == "drain"


def test_a_backend_that_reads_no_counters_is_never_a_pass(install, tmp_path):
    # GIVEN devices without the new readings (a backend that cannot give them)
    plain = healthy(0, pcie_replay_count=None, recovery_action=None, nvlinks=[NvLinkReading(0, True)])
    install(FakeBackend([plain]))
    # WHEN the quick level runs
    report = quick(tmp_path)
    # THEN each deeper check is unknown
    for name in ("recovery_action", "pcie_replay", "nvlink_errors"):
        (c,) = by_name(report, name)
        assert c.status is Status.UNKNOWN, c


def test_the_counter_window_is_the_run_and_can_be_widened(install, tmp_path):
    # GIVEN a healthy device and a minimum counter window of 0.3 s
    install(FakeBackend([healthy(0)]))
    # WHEN the quick level runs
    report = quick(tmp_path, counter_window_s=0.3)
    # THEN the counters were read at least that far apart (the window is in the details)
    (replay,) = by_name(report, "pcie_replay")
    assert replay.status is Status.PASS and replay.details["window_s"] >= 0.3


def test_skipped_deeper_checks_say_so(install, tmp_path):
    install(FakeBackend([healthy(0)]))
    report = quick(tmp_path, skip={"pcie_replay", "ib_counters"})
    assert by_name(report, "pcie_replay")[0].status is Status.SKIPPED
    assert by_name(report, "ib_counters")[0].reason == "skipped (--skip)"


# -- InfiniBand counters over a fake sysfs tree ---------------------------------------------
def ib_tree(root: Path, ports: dict[str, dict[str, int]], hw: dict[str, dict[str, int]] | None = None) -> None:
    """``ports``: ``{"mlx5_0/1": {counter: value}}`` under counters/, ``hw`` the same under hw_counters/."""
    for where, tree in (("counters", ports), ("hw_counters", hw or {})):
        for label, counters in tree.items():
            dev, port = label.split("/")
            folder = root / dev / "ports" / port / where
            folder.mkdir(parents=True, exist_ok=True)
            for name, value in counters.items():
                (folder / name).write_text(f"{value}\n")


QUIET = {"link_downed": 0, "symbol_error": 12, "port_rcv_errors": 0, "link_error_recovery": 1, "port_xmit_discards": 0}


def test_ib_link_downed_during_the_run_fails_steady_counters_pass(install, tmp_path, monkeypatch):
    # GIVEN two ports; mlx5_1's link goes down (and symbols are lost) while the check runs,
    # after the run's first read of the counters (a thread of its own: on a loaded machine it
    # may come late, so the flap waits for it)
    root = tmp_path / "infiniband"
    ib_tree(root, {"mlx5_0/1": QUIET, "mlx5_1/1": QUIET})
    first_read = threading.Event()
    real_read = runner_mod.read_ib_counters

    def read_and_tell(where: Any) -> Any:
        counters = real_read(where)
        first_read.set()
        return counters

    monkeypatch.setattr(runner_mod, "read_ib_counters", read_and_tell)

    def flap() -> None:
        assert first_read.wait(60), "the run never read the counters a first time"
        ib_tree(root, {"mlx5_1/1": {**QUIET, "link_downed": 1, "symbol_error": 40}})

    install(FakeBackend([healthy(0)], on_end=flap))

    # WHEN the quick level runs with that tree as /sys/class/infiniband
    report = quick(tmp_path, ib_root=str(root))

    # THEN the flapping port fails with the deltas, the quiet one passes
    results = {c.details["device"]: c for c in by_name(report, "ib_counters")}
    assert results["mlx5_0"].status is Status.PASS
    bad = results["mlx5_1"]
    assert (bad.status, bad.action) == (Status.FAIL, "drain")
    assert "link_downed +1" in bad.reason and "symbol_error +28" in bad.reason
    assert bad.details["deltas"]["symbol_error"] == 28


def test_ib_counters_read_from_hw_counters_and_congestion_only_warns(tmp_path):
    from healthcheck.checks.ib_counters import check_ib_counters, read_ib_counters

    # GIVEN a port whose counters are under hw_counters/, with xmit discards rising
    root = tmp_path / "ib"
    ib_tree(root, {}, hw={"irdma0/1": {"link_downed": 0, "port_xmit_discards": 5}})
    start = read_ib_counters(root)
    ib_tree(root, {}, hw={"irdma0/1": {"link_downed": 0, "port_xmit_discards": 9}})
    # WHEN judged
    (result,) = check_ib_counters(start, read_ib_counters(root), 2.0)
    # THEN the discards warn (congestion) and nothing fails
    assert result.status is Status.WARN and "port_xmit_discards +4" in result.reason


def test_ib_missing_saturated_or_unreadable_counters_are_never_a_pass(tmp_path):
    from healthcheck.checks.ib_counters import check_ib_counters, read_ib_counters

    # GIVEN a port without error counters, a saturated link_downed, and a counter that is not a number
    root = tmp_path / "ib"
    (root / "bare0" / "ports" / "1").mkdir(parents=True)
    ib_tree(root, {"sat0/1": {**QUIET, "link_downed": 255}, "junk0/1": {"symbol_error": 0}})
    (root / "junk0" / "ports" / "1" / "counters" / "link_downed").write_text("garbage\n")
    # WHEN read twice and judged
    start = read_ib_counters(root)
    results = {c.details["device"]: c for c in check_ib_counters(start, read_ib_counters(root), 1.0)}
    # THEN none of them passes
    assert results["bare0"].status is Status.SKIPPED
    assert results["sat0"].status is Status.UNKNOWN and "saturated" in results["sat0"].reason
    assert results["junk0"].status is Status.UNKNOWN and "link_downed" in results["junk0"].reason
    # AND no InfiniBand at all is skipped; a reading that did not return is unknown
    assert check_ib_counters({}, None, 0.0)[0].status is Status.SKIPPED
    (gone,) = check_ib_counters(None, None, 0.0, "reading x did not return in 10 s")
    assert gone.status is Status.UNKNOWN and "did not return" in gone.reason


# -- shared filesystems ------------------------------------------------------------------------
def test_a_shared_filesystem_that_answers_passes_and_leaves_no_file(install, tmp_path):
    # GIVEN a writable directory standing in for a shared filesystem
    share = tmp_path / "share"
    share.mkdir()
    install(FakeBackend([healthy(0)]))
    # WHEN the quick level probes it
    report = quick(tmp_path, shared_fs=[str(share)])
    # THEN it passes with its figures, and dynprof's probe file is gone
    (c,) = by_name(report, "shared_fs")
    assert c.status is Status.PASS, c
    assert set(c.details["steps"]) == {"statvfs", "create", "write", "read", "unlink"}
    assert c.details["free_bytes"] > 0
    assert list(share.iterdir()) == []


def test_a_shared_filesystem_path_that_is_not_there_fails(install, tmp_path):
    install(FakeBackend([healthy(0)]))
    report = quick(tmp_path, shared_fs=[str(tmp_path / "not-mounted")])
    (c,) = by_name(report, "shared_fs")
    assert (c.status, c.action) == (Status.FAIL, "drain") and "not mounted" in c.reason


def stuck_probe_code(tmp_path: Path) -> str:
    """A probe that names its step, then blocks inside a system call: open() of a FIFO that
    nobody writes to stands in for a hung NFS statvfs."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return f"print('step statvfs', flush=True)\nopen({str(fifo)!r}).read()\n"


def test_a_shared_filesystem_stuck_in_a_system_call_fails_naming_the_step(tmp_path, parked):
    from healthcheck.checks.shared_fs import SharedFsProbe

    # GIVEN a probe blocked in its statvfs step
    probe = SharedFsProbe("/mnt/stuck", 0.5, argv=[sys.executable, "-c", stuck_probe_code(tmp_path)]).start()
    assert probe.proc is not None
    parked(probe.proc.pid)

    # WHEN it is collected after its limit
    result = probe.result()

    # THEN the filesystem fails naming the step that did not return, and the child was killed
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert result.reason == "/mnt/stuck: statvfs did not return in 0.5 s (the filesystem does not answer)"
    assert probe.proc.wait(timeout=60) == -9


def test_a_stuck_shared_filesystem_does_not_hold_up_the_run(install, tmp_path, monkeypatch):
    from healthcheck.checks import shared_fs

    # GIVEN every shared-filesystem probe blocks in a system call
    monkeypatch.setattr(shared_fs, "PROBE_CODE", stuck_probe_code(tmp_path))
    install(FakeBackend([healthy(0)]))

    # WHEN the quick level probes one with a 0.5 s limit
    report = quick(tmp_path, shared_fs=["/mnt/stuck"], probe_timeout_s=0.5)

    # THEN the run returned and the filesystem fails with its limit
    (c,) = by_name(report, "shared_fs")
    assert (c.status, c.action) == (Status.FAIL, "drain")
    assert "did not return in 0.5 s (the filesystem does not answer)" in c.reason


def test_a_read_only_shared_filesystem_warns_and_mounts_are_found_without_touching_the_path():
    from healthcheck.checks.shared_fs import SharedFsProbe, mount_of

    # GIVEN a probe that reports a read-only filesystem
    report = '{"steps": {"statvfs": 0.001}, "failed": "create", "errno": "EROFS", "error": "Read-only file system"}'
    code = f"print({report!r})"
    probe = SharedFsProbe("/data", 30.0, argv=[sys.executable, "-c", code]).start()
    # WHEN collected
    result = probe.result(mounts_text="nfs1:/export /data nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")
    # THEN it warns, and the mount is named
    assert result.status is Status.WARN and "cannot write" in result.reason
    assert result.details["mount"] == {"mount_point": "/data", "fstype": "nfs4", "source": "nfs1:/export"}
    assert mount_of("/data2/x", "nfs1:/e /data nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")["mount_point"] == "/"


def test_shared_fs_comes_from_the_option_or_the_environment(monkeypatch):
    import argparse

    from healthcheck.arguments import add_check_arguments, request_from_args

    def options_from_args(args: argparse.Namespace) -> Options:
        return request_from_args(args).options()

    parser = argparse.ArgumentParser()
    add_check_arguments(parser)
    args = parser.parse_args(
        ["--shared-fs", "/a", "--shared-fs", "/b", "--probe-timeout", "3", "--counter-window", "2"]
    )
    options = options_from_args(args)
    assert options.shared_fs_paths() == ["/a", "/b"]
    assert (options.probe_timeout_s, options.counter_window_s) == (3.0, 2.0)
    monkeypatch.setenv("DYNPROF_HEALTHCHECK_SHARED_FS", "/x:/y")
    assert options_from_args(parser.parse_args([])).shared_fs_paths() == ["/x", "/y"]
    assert options_from_args(parser.parse_args([])).to_json()["read_timeout_s"] == 10.0


# -- the process exits although a probe thread never returns ---------------------------------
def test_a_probe_thread_that_never_returns_does_not_keep_the_process_alive(tmp_path):
    # GIVEN a process whose device read blocks forever in a daemon probe thread
    program = textwrap.dedent(
        f"""
        import sys, threading
        sys.path.insert(0, {str(ROOT / "tests" / "unit")!r})
        from healthcheck import runner
        from healthcheck.options import Options
        from test_healthcheck_deep import FakeBackend, healthy
        backend = FakeBackend([healthy(0)], hang_read={{0}})
        runner.open_backend = lambda kind, tool: backend
        runner.xidlog.read_kernel_log_xids = lambda window, now=None: ([], "test")
        report = runner.run(Options(level="quick", disk_paths=["/"], min_disk_gib=0.001,
                                           ib_root={str(tmp_path)!r}, shared_fs=[], probe_timeout_s=0.5))
        print([c.reason for c in report.checks if c.name == "device_read"][0], flush=True)
        """
    )
    # WHEN it runs to the end of its main thread
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=str(ROOT), env=None
    )
    # THEN it exited (the subprocess timeout is a hang detector, not a measurement) with the report
    assert proc.returncode == 0, proc.stderr
    assert "did not return in 0.5 s" in proc.stdout


# -- the smi backend (ppu-smi and the like) -------------------------------------------------
FAKE_SMI = """#!{python}
import sys
VALUES = {values!r}
args = [a for a in sys.argv[1:] if not a.startswith("--id=")]
if args[0] == "--help-query-gpu":
    for name in VALUES:
        print('"%s"' % name)
        print("    doc")
elif args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    unknown = [f for f in fields if f not in VALUES]
    if unknown:
        print('Field "%s" is not a valid field to query.' % unknown[0], file=sys.stderr)
        sys.exit(2)
    print(", ".join(VALUES[f] for f in fields))
else:
    print("Invalid combination of input arguments", file=sys.stderr)
    sys.exit(2)
"""

SMI_BASE = {"index": "0", "name": "PPU-ZW810E", "uuid": "PPU-0001", "pci.bus_id": "00000000:3B:00.0"}


def smi_tool(tmp_path: Path, name: str, values: dict[str, str]) -> str:
    tool = tmp_path / name
    tool.write_text(FAKE_SMI.format(python=sys.executable, values={**SMI_BASE, **values}))
    tool.chmod(0o755)
    return str(tool)


def test_smi_tool_without_the_fields_skips_the_deeper_checks_as_not_exposed(tmp_path):
    from healthcheck.backends.smi import SmiBackend
    from healthcheck.checks.counters import counter_checks

    # GIVEN a ppu-smi that lists none of the deeper fields
    backend = SmiBackend.open(smi_tool(tmp_path, "ppu-smi", {}))
    start, end = backend.read(0), backend.read_counters(0)
    # WHEN the deeper checks judge what it read
    results = {c.name: c for c in counter_checks(start, backend.name, end, 1.0)}
    # THEN each is skipped as not exposed by the tool, never passed
    for name in ("recovery_action", "pcie_replay", "nvlink_errors"):
        assert results[name].status is Status.SKIPPED, results[name]
        assert results[name].reason == "not exposed by " + str(tmp_path / "ppu-smi")


def test_smi_tool_with_reset_status_fields_fails_a_device_that_needs_a_reset(tmp_path):
    from healthcheck.backends.smi import SmiBackend

    # GIVEN an smi tool whose reset status says a reset is required
    fields = {"reset_status.reset_required": "Yes", "reset_status.drain_and_reset_recommended": "No"}
    backend = SmiBackend.open(smi_tool(tmp_path, "nvidia-smi", fields))
    # WHEN read at the start and the end and judged
    start, end = backend.read(0), backend.read_counters(0)
    result = check_recovery_action(start, backend.name, end)
    # THEN the device fails and needs a reset
    assert (start.reset_required, end.reset_required) == (True, True)
    assert (result.status, result.action) == (Status.FAIL, "reset")
    # AND with "No" on both it passes
    healthy_tool = smi_tool(tmp_path, "ok-smi", {**fields, "reset_status.reset_required": "No"})
    ok = SmiBackend.open(healthy_tool)
    assert check_recovery_action(ok.read(0), ok.name, ok.read_counters(0)).status is Status.PASS


@pytest.mark.parametrize(
    "argv",
    [
        ["--probe-timeout", "0"],
        ["--probe-timeout", "nan"],
        ["--probe-timeout", "-1"],
        ["--probe-timeout", "1e9"],
        ["--counter-window", "-1"],
        ["--counter-window", "inf"],
        ["--shared-fs", "a\x00b"],
    ],
)
def test_bad_probe_options_are_usage_errors_exit_3(argv, capsys):
    from healthcheck.cli import main

    # WHEN python -m healthcheck gets a value its parser refuses
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--no-save"])
    # THEN it exits 3 ("could not run"), never 2 ("unhealthy"), and says which option
    assert exc.value.code == 3
    assert argv[0] in capsys.readouterr().err


def test_a_shared_fs_path_that_is_not_a_directory_fails_naming_the_step(tmp_path):
    from healthcheck.checks.shared_fs import SharedFsProbe

    # GIVEN a regular file given as a shared filesystem
    plain = tmp_path / "file"
    plain.write_text("x")
    # WHEN probed
    result = SharedFsProbe(str(plain), 60.0).start().result()
    # THEN it fails at the step that could not be taken
    assert result.status is Status.FAIL and "create failed" in result.reason and "ENOTDIR" in result.reason


def test_a_host_probe_that_never_returns_is_unknown_alone(install, tmp_path, monkeypatch):
    from healthcheck.checks import host

    # GIVEN a disk whose statvfs never returns (a hung mount given as --disk)
    release = threading.Event()
    monkeypatch.setattr(host, "read_disk", lambda path, min_free: release.wait())
    install(FakeBackend([healthy(0)]))
    try:
        # WHEN the quick level runs with a 3 s probe limit (long enough for the other probes,
        # which answer in milliseconds, to answer on a loaded machine too)
        report = quick(tmp_path, probe_timeout_s=3.0)
    finally:
        release.set()

    # THEN that disk is unknown, naming what did not return, and the other host checks were judged
    (disk,) = by_name(report, "disk_free")
    assert disk.status is Status.UNKNOWN and disk.reason == "statvfs of / did not return in 3 s"
    for name in ("shm_size", "host_memory", "host_processes", "ib_ports"):
        assert by_name(report, name) and all(c.status is not Status.UNKNOWN for c in by_name(report, name)), name


def test_an_smi_tool_run_that_does_not_return_is_named(install, tmp_path):
    from healthcheck.backends.smi import SmiBackend

    # GIVEN an smi tool that answers at the start and hangs (3 s) on the counters' query at the end
    fields = {"reset_status.reset_required": "No", "reset_status.drain_and_reset_recommended": "No"}
    tool = Path(smi_tool(tmp_path, "slow-smi", fields))
    tool.write_text(
        tool.read_text().replace(
            'elif args[0].startswith("--query-gpu="):',
            'elif args[0].startswith("--query-gpu=index,reset_status"):\n    import time; time.sleep(3)\n'
            'elif args[0].startswith("--query-gpu="):',
        )
    )
    backend = SmiBackend.open(str(tool))
    backend.release = threading.Event()  # type: ignore[attr-defined]
    install(backend)

    # WHEN the quick level runs with a 0.5 s probe limit
    report = quick(tmp_path, probe_timeout_s=0.5)

    # THEN the recovery check is unknown and names the tool run that did not return
    (c,) = by_name(report, "recovery_action")
    assert c.status is Status.UNKNOWN, c
    assert f"{tool} --query-gpu=index,reset_status.reset_required" in c.reason and "did not return in 0.5 s" in c.reason


def test_a_device_count_that_never_returns_is_unknown_and_the_driver_is_not_asked_again(install, tmp_path):
    # GIVEN a backend whose device count blocks forever
    backend = FakeBackend([healthy(0)])

    def count() -> int:
        backend.in_flight.enter("fakeDeviceGetCount")
        backend.release.wait()
        return 1

    backend.device_count = count  # type: ignore[method-assign]
    install(backend)

    # WHEN the quick level runs
    report = quick(tmp_path, probe_timeout_s=0.5)

    # THEN the device count is unknown (critical: exit 3), naming the call; NVML is not shut down
    (devices,) = by_name(report, "devices")
    assert devices.status is Status.UNKNOWN and devices.critical
    assert devices.reason == "fake call fakeDeviceGetCount did not return in 0.5 s"
    assert report.exit_code == 3 and backend.closed is False
