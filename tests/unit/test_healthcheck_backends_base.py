"""healthcheck.backends.base: the error a node without accelerators gets, the live XID event,
and the interface every backend implements."""

from __future__ import annotations

from dynprof.errors import DynprofError
from healthcheck.backends.base import Backend, NoAccelerator, XidEvent
from healthcheck.readings import DeviceReadings
from healthcheck.result import EXIT_COULD_NOT_RUN


def test_no_accelerator_is_a_dynprof_error_that_exits_could_not_run():
    # GIVEN the error raised when no accelerator is found
    err = NoAccelerator("no accelerator found (nvml: not loaded)")
    # THEN a person sees it as a dynprof error, the run exits 3 ("could not run")
    assert isinstance(err, DynprofError)
    assert err.exit_code == EXIT_COULD_NOT_RUN == 3
    assert str(err) == "no accelerator found (nvml: not loaded)"


def test_no_accelerator_help_says_how_to_run_the_host_checks_only():
    # GIVEN no help given by the raiser
    err = NoAccelerator("none")
    # THEN the default help names the driver tools, the container flag and --expect-devices 0
    assert "--expect-devices 0" in err.help
    assert "nvidia-smi" in err.help and "--gpus all" in err.help


def test_no_accelerator_keeps_a_help_given_by_the_raiser():
    assert NoAccelerator("none", help="install the driver").help == "install the driver"


def test_an_xid_event_may_name_no_device():
    # GIVEN an XID the driver reported without a device (node-wide)
    event = XidEvent(device=None, xid=79)
    # THEN it is kept as such and compares by value
    assert event.device is None and event.xid == 79
    assert event == XidEvent(None, 79) and event != XidEvent(0, 79)


class _FakeBackend:
    name = "fake"

    def device_count(self) -> int:
        return 1

    def driver_version(self) -> str | None:
        return "550.0"

    def read(self, index: int) -> DeviceReadings:
        return DeviceReadings(index=index)

    def read_counters(self, index: int) -> DeviceReadings:
        return DeviceReadings(index=index)

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        return (5, 16)

    def watch_xid(self) -> bool:
        return False

    def xid_events(self) -> list[XidEvent]:
        return []

    def close(self) -> None:
        return None


def test_a_plain_class_with_the_methods_is_a_backend_without_inheriting():
    # GIVEN a class that only has the methods (as the tests' fake backends do)
    backend: Backend = _FakeBackend()
    # WHEN used through the protocol's methods
    # THEN it answers as a backend
    assert backend.read(2).index == 2
    assert backend.read_pcie(0) == (5, 16)
    for method in ("device_count", "driver_version", "read", "read_counters", "read_pcie", "watch_xid"):
        assert hasattr(Backend, method), f"the protocol lost {method}"
