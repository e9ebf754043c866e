"""The GPU step marker in the step hook (dynprof/agent/_gpu_step.py) and the status's gpu_step:
on CPU torch, a step records nothing and says why; with a CUDA that reports itself initialised
(a stand-in for torch.cuda), two events are recorded in turn, queried only when asked, and any
failure turns the marker off with one log line and never reaches the training step."""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import Any

import pytest
import torch

from dynprof.agent import _core_handlers
from dynprof.agent._gpu_step import MIN_GAP_S, NOT_RELAXED, PROBE_AFTER_S, GpuStepMarker
from dynprof.agent._steps import StepTracker
from dynprof.proto import pb


@pytest.fixture(autouse=True)
def _relaxed_capture_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in CUDA's threads can relax their capture mode (a test says where they cannot)."""
    from dynprof.agent import _gpu_step

    monkeypatch.setattr(_gpu_step, "_capture_relaxed", lambda: True)


def _installed_tracker() -> StepTracker:
    tracker = StepTracker()
    tracker.install()
    assert tracker.hook_installed
    return tracker


def _status_of(tracker: StepTracker) -> Any:
    agent = types.SimpleNamespace(
        handlers={},
        identity=types.SimpleNamespace(job_id="j", rank=0, world_size=1),
        steps=tracker,
        pid=1,
        started_at=0.0,
        role="trainer",
        cuda_initialized=lambda: False,
    )
    _core_handlers.install(agent)  # type: ignore[arg-type]
    kind, status = agent.handlers["status"](pb.StatusRequest())
    assert kind == "status"
    return status


def test_a_cpu_step_records_no_event_and_the_status_says_why():
    # GIVEN the step hook installed in a process whose torch has no CUDA initialised
    tracker = _installed_tracker()
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # WHEN it trains three steps on the CPU
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        status = _status_of(tracker)
    finally:
        tracker.uninstall()
    # THEN the steps are counted, no event was made, the marker is still on, and the status's
    # gpu_step says no step ran on CUDA
    assert tracker.step == 3
    assert tracker.gpu.enabled and tracker.gpu._events == []
    g = status.gpu_step
    assert (g.recorded, g.step, g.done, g.device, g.note) == (False, 0, False, -1, "no optimizer step on CUDA yet")


class FakeEvent:
    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.recorded_on: list[Any] = []
        self.finished = False

    def record(self, stream: Any) -> None:
        self.recorded_on.append(stream)

    def query(self) -> bool:
        return self.finished


class FakeCuda:
    """What the marker calls of torch.cuda, on device 1 of a process whose CUDA is initialised."""

    Event = FakeEvent

    def __init__(self, initialized: bool = True, capturing: bool = False) -> None:
        self.initialized = initialized
        self.capturing = capturing
        self.stream = types.SimpleNamespace(device_index=1, cuda_stream=0)  # the default stream
        self.default = types.SimpleNamespace(device_index=1, cuda_stream=0, name="default")
        self.devices_entered: list[int] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def current_stream(self) -> Any:
        return self.stream

    def get_device_properties(self, device: int) -> Any:
        return types.SimpleNamespace(uuid="3f1c0000-aaaa-bbbb-cccc-000000000001")

    def default_stream(self, device: int) -> Any:
        return self.default

    def device(self, device: int) -> Any:
        import contextlib

        self.devices_entered.append(device)
        return contextlib.nullcontext()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _optimizer(on_cuda: bool) -> Any:
    return types.SimpleNamespace(param_groups=[{"params": [types.SimpleNamespace(is_cuda=on_cuda)]}])


def test_steps_on_cuda_record_two_events_in_turn_queried_only_when_asked():
    # GIVEN a marker, a CUDA that is initialised, and an optimizer of CUDA parameters
    FakeEvent.made = 0
    fake = types.SimpleNamespace(cuda=FakeCuda())
    clock = FakeClock()
    marker = GpuStepMarker(clock=clock)
    opt = _optimizer(True)
    # WHEN five steps of 20 ms are marked
    for step in range(1, 6):
        clock.now += 0.020
        marker.mark(fake, opt, step)
    # THEN two events were made, recorded in turn on the current stream, none queried yet
    assert FakeEvent.made == 2
    first, second = marker._events
    assert (len(first.recorded_on), len(second.recorded_on)) == (3, 2)
    # and a look names step 5, not finished, on device 1 with its UUID
    look = marker.look(fake)
    assert (look.recorded, look.step, look.done, look.device) == (True, 5, False, 1)
    assert look.device_uuid == "GPU-3f1c0000-aaaa-bbbb-cccc-000000000001" and look.age_s >= 0.0
    # WHEN the GPU finishes that step's work
    marker._events[marker._slot].finished = True
    # THEN the next look says so
    assert marker.look(fake).done is True
    # AND the device a trace's manifest records is that one: its index and UUID
    assert marker.device_identity(fake) == {"index": 1, "uuid": "GPU-3f1c0000-aaaa-bbbb-cccc-000000000001"}
    assert GpuStepMarker().device_identity(fake) is None  # no step marked yet


def test_steps_shorter_than_the_gap_are_marked_at_most_every_10_ms_and_the_look_says_which():
    # GIVEN a marker on CUDA and steps of 2**-9 s (1.95 ms, exact in binary)
    FakeEvent.made = 0
    fake = types.SimpleNamespace(cuda=FakeCuda())
    clock = FakeClock()
    marker = GpuStepMarker(clock=clock)
    opt = _optimizer(True)
    tick = 2.0**-9
    # WHEN 35 steps are marked
    for step in range(1, 36):
        clock.now = 1024.0 + step * tick
        marker.mark(fake, opt, step)
    # THEN a step is marked only 10 ms after the last record or later: steps 1, 7, 13, 19, 25, 31
    first, second = marker._events
    assert (len(first.recorded_on), len(second.recorded_on)) == (3, 3)
    # and the look names the step the event marks, not the last one
    assert marker.look(fake).step == 31
    # WHEN the next step comes more than MIN_GAP_S after that record
    clock.now = 1024.0 + 31 * tick + MIN_GAP_S + tick
    marker.mark(fake, opt, 36)
    # THEN it is marked
    assert marker.look(fake).step == 36


@pytest.mark.parametrize(
    "cuda, on_cuda",
    [(FakeCuda(initialized=False), True), (FakeCuda(), False), (FakeCuda(capturing=True), True)],
    ids=["cuda-not-initialised", "cpu-parameters", "graph-capture"],
)
def test_no_event_without_cuda_for_cpu_parameters_or_in_a_graph_capture(cuda, on_cuda):
    # GIVEN CUDA not initialised, an optimizer of CPU parameters, or a CUDA graph being captured
    FakeEvent.made = 0
    marker = GpuStepMarker()
    # WHEN a step is marked
    marker.mark(types.SimpleNamespace(cuda=cuda), _optimizer(on_cuda), 1)
    # THEN no event is made or recorded, and the marker stays on
    assert FakeEvent.made == 0 and marker.enabled
    assert marker.look(None).recorded is False


def test_a_failing_event_turns_the_marker_off_with_one_log_line_and_never_reaches_the_step(caplog):
    # GIVEN the step hook, with a CUDA whose event record fails
    class Broken(FakeEvent):
        def record(self, stream: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    cuda = FakeCuda()
    cuda.Event = Broken  # type: ignore[misc]
    tracker = StepTracker()
    from dynprof.agent import _steps

    saved = _steps._TORCH[0]
    _steps._TORCH[0] = types.SimpleNamespace(cuda=cuda)
    opt = _optimizer(True)
    try:
        # WHEN the job steps three times
        with caplog.at_level(logging.INFO, logger="dynprof.agent"):
            for _ in range(3):
                tracker._eager_step(opt)
    finally:
        _steps._TORCH[0] = saved
    # THEN the steps are counted, the marker is off, said once, and the status says why
    assert tracker.step == 3
    assert not tracker.gpu.enabled
    lines = [r.getMessage() for r in caplog.records if "GPU step marker" in r.getMessage()]
    assert len(lines) == 1 and "illegal memory access" in lines[0]
    look = tracker.gpu.look(None)
    assert look.recorded is False and look.note.startswith("off for this process: recording its CUDA event failed")


def _stalled_marker(monkeypatch: pytest.MonkeyPatch, relaxed: bool = True, side_stream: bool = False) -> Any:
    """A marker whose last step (step 5, on device 1) was marked, then no step for 3 s."""
    from dynprof.agent import _gpu_step

    monkeypatch.setattr(_gpu_step, "_capture_relaxed", lambda: relaxed)
    FakeEvent.made = 0
    cuda = FakeCuda()
    if side_stream:
        cuda.stream = types.SimpleNamespace(device_index=1, cuda_stream=0x7F00)
    fake = types.SimpleNamespace(cuda=cuda)
    clock = FakeClock()
    marker = GpuStepMarker(clock=clock)
    marker.mark(fake, _optimizer(True), 5)
    return marker, fake, clock


def _recorded(marker: GpuStepMarker, records: int) -> Any:
    """The probe's event once the probe's thread has recorded it ``records`` times."""
    deadline = time.monotonic() + 60.0  # a bound on a hang, not a timing
    prober = marker._prober
    while time.monotonic() < deadline:
        with prober._lock:
            event, busy = prober._event, prober._recording_since is not None
        if event is not None and len(event.recorded_on) >= records and not busy:
            return event
        time.sleep(0.005)
    raise AssertionError(f"the probe's thread made no record {records} (off: {prober.off_reason!r})")


class BlockingEvent(FakeEvent):
    """A record that does not return until released (the driver holds it while another thread
    copies between host and device behind a kernel that does not end)."""

    release = threading.Event()

    def record(self, stream: Any) -> None:
        BlockingEvent.release.wait(60)
        super().record(stream)


def test_a_rank_that_stopped_stepping_gets_a_progress_probe_on_its_default_stream(monkeypatch):
    # GIVEN a rank on CUDA whose last step was marked, and no step since
    marker, fake, clock = _stalled_marker(monkeypatch)
    # WHEN it is looked at before PROBE_AFTER_S has passed
    clock.now += PROBE_AFTER_S / 2
    look = marker.look(fake)
    # THEN no probe: a rank that steps costs nothing more
    assert look.probed is False and marker._prober._thread is None
    # WHEN it is looked at once that time has passed
    clock.now += PROBE_AFTER_S
    look = marker.look(fake)
    # THEN a probe is recorded on the device's default stream (on its device) by the probe's own
    # thread; none is reported yet
    assert look.probed is False
    probe = _recorded(marker, 1)
    assert probe.recorded_on == [fake.cuda.default] and fake.cuda.devices_entered == [1]
    assert marker._prober._thread is not None and marker._prober._thread.name == "dynprof-gpu-probe"
    # WHEN the next look comes 1.5 s later, the GPU still busy with what was queued before
    clock.now += 1.5
    look = marker.look(fake)
    # THEN it says the probe has not finished after 1.5 s, and asks for the next one
    assert (look.probed, look.probe_done, look.probe_age_s) == (True, False, 1.5)
    _recorded(marker, 2)
    # WHEN the GPU gets through its queue
    probe.finished = True
    clock.now += 0.5
    look = marker.look(fake)
    # THEN the next look says so
    assert (look.probed, look.probe_done, look.probe_age_s) == (True, True, 0.5)
    # WHEN the rank steps again
    _recorded(marker, 3)
    clock.now += 1.0
    marker.mark(fake, _optimizer(True), 6)
    look = marker.look(fake)
    # THEN no probe is reported, and a later stall starts afresh
    assert look.probed is False and marker._prober._recorded_at is None


def test_a_probe_record_that_does_not_return_never_holds_the_agent_and_reads_as_behind(monkeypatch):
    # GIVEN a stalled rank whose probe record does not return (another thread copies behind a
    # kernel that does not end)
    marker, fake, clock = _stalled_marker(monkeypatch)
    fake.cuda.Event = BlockingEvent
    BlockingEvent.release.clear()
    try:
        clock.now += PROBE_AFTER_S
        # WHEN the agent is asked for its status again and again
        first = marker.look(fake)
        deadline = time.monotonic() + 60.0
        while marker._prober._recording_since is None and time.monotonic() < deadline:
            time.sleep(0.005)
        clock.now += 3.0
        looks = [marker.look(fake) for _ in range(3)]
        # THEN every look answers (the agent's thread never waits for the record), and says the
        # GPU has not taken the probe for 3 s: behind
        assert first.probed is False
        assert all((lk.probed, lk.probe_done, lk.probe_age_s) == (True, False, 3.0) for lk in looks)
        assert marker._prober._thread.is_alive()
    finally:
        BlockingEvent.release.set()
    # WHEN the record returns at last
    _recorded(marker, 1)
    # THEN the next look reports that record
    look = marker.look(fake)
    assert look.probed is True and look.probe_done is False and look.probe_age_s == 0.0


@pytest.mark.parametrize("relaxed, side_stream", [(False, False), (True, True)], ids=["capture-mode", "side-stream"])
def test_no_probe_without_a_relaxed_capture_mode_or_off_the_default_stream(monkeypatch, relaxed, side_stream):
    # GIVEN a stalled rank whose threads could not relax their capture mode, or whose steps run
    # on a side stream (which a CUDA graph capture could be using)
    marker, fake, clock = _stalled_marker(monkeypatch, relaxed=relaxed, side_stream=side_stream)
    # WHEN it is looked at twice, long after its last step
    for _ in range(2):
        clock.now += 2 * PROBE_AFTER_S
        look = marker.look(fake)
    # THEN no probe was recorded, and the marker is still on
    assert look.probed is False and marker._prober._event is None and marker.enabled
    if relaxed:
        assert look.recorded is True and look.step == 5
    else:
        # and without a relaxed capture mode the marker's event is not even queried
        assert look.recorded is False and look.note == NOT_RELAXED
        assert marker._events[marker._slot].recorded_on and fake.cuda.devices_entered == []
