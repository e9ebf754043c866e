"""The `auto` memory-history policy: the plan it makes from an event rate, and the controller
thread driving PyTorch's recording switch (with the allocator's counters faked)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dynprof.agent import _mem_auto
from dynprof.agent._mem_auto import EVENT_COST_S, AutoHistory, plan

torch = pytest.importorskip("torch")


def test_a_light_loop_is_recorded_all_the_time():
    # GIVEN 1 000 events/s: 0.25 % of wall time at 2.5 us each, under the 0.5 % budget
    p = plan(1_000, 0.005, step_time_s=0.1)
    assert p.recording == "continuous" and p.duty == 1.0
    assert "within the 0.5 % budget" in p.reason()


def test_an_idle_process_costs_nothing_to_record():
    assert plan(0, 0.005, None).recording == "continuous"


@pytest.mark.parametrize(("rate", "step"), [(200_000, 0.005), (40_000, 0.025), (3_000, 0.3), (10_000_000, 0.001)])
def test_a_heavy_loop_is_recorded_in_windows_that_keep_the_cost_in_budget(rate, step):
    # GIVEN an allocator rate whose continuous recording would cost more than the budget
    budget = 0.005
    p = plan(rate, budget, step_time_s=step)

    # THEN it records in windows, and the estimated cost of what it records is the budget
    assert p.recording == "windows"
    assert p.estimated_cost == pytest.approx(rate * EVENT_COST_S)
    assert p.duty * p.estimated_cost == pytest.approx(budget, rel=1e-6)
    assert p.period_s <= _mem_auto.MAX_PERIOD_S + 1e-9
    assert p.window_s <= _mem_auto.MAX_WINDOW_S
    assert "over the 0.5 % budget" in p.reason()


def test_windows_cover_more_than_a_step_when_the_budget_allows():
    p = plan(200_000, 0.005, step_time_s=0.005)  # launch-bound: 5 ms steps
    assert p.window_s == pytest.approx(0.02)  # 1.5 steps, at least 20 ms
    assert p.period_s == pytest.approx(0.02 / (0.005 / 0.5))


class FakeAllocator:
    """The allocator's counter, advancing at ``rate`` events per second of wall time, and the
    recording switch, logged with the time of each change."""

    def __init__(self, monkeypatch, rate: float) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.switches: list[tuple[float, bool]] = []
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.stats, raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)

    def stats(self, device: int) -> dict:
        n = int((time.monotonic() - self.t0) * self.rate)
        return {"allocation": {"all": {"allocated": n // 2, "freed": n - n // 2}}}

    def record(self, enabled=None, **kw) -> None:
        self.switches.append((time.monotonic(), enabled is not None))

    def on_fraction(self, until: float) -> float:
        on_time, since = 0.0, None
        for t, on in self.switches:
            if on and since is None:
                since = t
            elif not on and since is not None:
                on_time, since = on_time + (t - since), None
        if since is not None:
            on_time += until - since
        return on_time / (until - self.t0)


def _wait_until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the controller did not get there"
        time.sleep(0.02)


def test_the_controller_records_a_fraction_of_the_time_on_a_heavy_loop(monkeypatch):
    # GIVEN an allocator making 40 000 events/s (10 % to record all the time) and a 5 % budget
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.05)
    alloc = FakeAllocator(monkeypatch, 40_000)
    auto = AutoHistory(budget=0.05, step_time=lambda: 0.02)

    # WHEN it runs until it has recorded five windows (however long a loaded machine takes)
    auto.start()
    _wait_until(lambda: auto.windows >= 5)
    auto.stop()

    # THEN it planned windows, on about half the time
    p = auto.plan
    assert p is not None and p.recording == "windows"
    assert 0.25 <= p.duty <= 0.6, p
    # AND switched by that plan: on and off in turn, each window (but one cut short by the
    # stop) at least as long as planned, each gap at least the rest of its period; recording
    # left off
    states = [on for _, on in alloc.switches]
    assert states[0] is True and all(a != b for a, b in itertools.pairwise(states)), states
    spans = [(on, b - a) for (a, on), (b, _) in itertools.pairwise(alloc.switches)][:-1]
    assert min(d for on, d in spans if on) >= p.window_s * 0.9, (spans, p)
    assert min(d for on, d in spans if not on) >= (p.period_s - p.window_s) * 0.9, (spans, p)
    assert alloc.switches[-1][1] is False and not auto.running


def test_the_controller_records_all_the_time_on_a_light_loop(monkeypatch):
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.05)
    alloc = FakeAllocator(monkeypatch, 100)
    auto = AutoHistory(budget=0.005)
    auto.start()
    _wait_until(lambda: auto.recording)
    time.sleep(0.5)  # later checks (as many as the machine runs) would switch it off: none does
    assert auto.recording and [on for _, on in alloc.switches] == [True]
    auto.stop()
    assert alloc.switches[-1][1] is False


def test_a_failing_allocator_read_turns_recording_off_and_ends_quietly(monkeypatch, caplog):
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.02)
    alloc = FakeAllocator(monkeypatch, 100)

    def broken(device: int) -> dict:
        raise RuntimeError("no allocator")

    auto = AutoHistory(budget=0.005)
    auto.start()
    _wait_until(lambda: auto.recording)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", broken, raising=False)
    _wait_until(lambda: not auto.running)
    assert alloc.switches[-1][1] is False
    assert "memory history (auto) failed" in caplog.text


class ThreadLog(FakeAllocator):
    """The fake allocator, with the thread of every call into it."""

    def __init__(self, monkeypatch, rate: float) -> None:
        super().__init__(monkeypatch, rate)
        self.threads: list[str] = []

    def stats(self, device: int) -> dict:
        self.threads.append(threading.current_thread().name)
        return super().stats(device)

    def record(self, enabled=None, **kw) -> None:
        self.threads.append(threading.current_thread().name)
        super().record(enabled, **kw)


def test_every_call_into_the_allocator_runs_on_the_main_thread(monkeypatch):
    # GIVEN the controller in a job that steps on its main thread (a call into the allocator
    # from another thread could wait for its lock with the GIL held and stop every thread)
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.02)
    alloc = ThreadLog(monkeypatch, 40_000)
    main = threading.get_ident()
    auto = AutoHistory(budget=0.05, step_time=lambda: 0.02, trainer_thread=lambda: main)

    # WHEN it reads the counters and switches recording, windows after windows
    auto.start()
    _wait_until(lambda: auto.windows >= 3)
    auto.stop()

    # THEN the main thread made every one of those calls, the switch-off at the stop included
    assert alloc.threads and set(alloc.threads) == {threading.main_thread().name}, set(alloc.threads)
    assert alloc.switches[-1][1] is False and not auto.running


def test_a_main_thread_in_a_long_c_call_gets_no_allocator_call_and_none_runs_late(monkeypatch):
    # GIVEN a main thread that runs no pending call (inside a long C call: an empty_cache behind
    # the GPU): the calls handed to it stay queued
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.02)
    monkeypatch.setattr(_mem_auto, "ON_MAIN_WAIT_S", 0.1)
    alloc = ThreadLog(monkeypatch, 100)
    queued: list = []
    auto = AutoHistory(budget=0.005, call_on_main=lambda fn: queued.append(fn) or True)

    # WHEN the controller has tried several times, and the main thread then runs them all
    auto.start()
    _wait_until(lambda: auto.missed >= 3)
    auto.stop()
    for task in list(queued):
        task()

    # THEN nothing reached the allocator: each call was cancelled when it was not run in time
    assert alloc.threads == [] and alloc.switches == []
    assert not auto.recording and not auto.running


def test_a_job_stepping_on_another_thread_gets_the_calls_on_the_controllers_thread(monkeypatch):
    # GIVEN a job whose optimizer steps run on a thread other than the main one (its main
    # thread may never run Python again: pending calls would never run)
    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.02)
    alloc = ThreadLog(monkeypatch, 100)
    auto = AutoHistory(budget=0.005, trainer_thread=lambda: -1)

    # WHEN it records
    auto.start()
    _wait_until(lambda: auto.recording)
    auto.stop()

    # THEN its own thread read the counters and switched, as the only thread that can
    assert "dynprof-memory-auto" in alloc.threads and threading.main_thread().name not in alloc.threads[:-1]
