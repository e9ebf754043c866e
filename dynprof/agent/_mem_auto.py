"""The ``auto`` memory-history policy: record allocation stacks only as much as the job affords.

Recording every allocator event with its Python stack costs about 1.2-2 us of the training
thread's time per event (measured on an H200, scripts/bench_memory_history.py). A launch-bound
loop makes ~100 000-200 000 events a second, so recording all the time would cost it 10-25 %;
a GPU-bound loop hides most of that cost behind the GPU. ``auto`` keeps the cost under a budget
(0.5 % of wall time by default) whatever the loop:

* A daemon thread reads the allocator's own counters (``allocation.all.allocated`` and
  ``.freed`` of every device: they are kept whether or not anything records) twice a second
  and estimates what recording would cost: ``events per second x cost per event``.
* If that is within the budget, it records all the time (a full recent history at OOM).
* Otherwise it records in windows: on for W (1.5 steps, 20-500 ms), off for as long as keeps
  ``W / period x estimated cost`` within the budget. A window samples the allocations of a
  moment of the job; the blocks allocated in windows keep their stacks while they live, so a
  leak, which grows over many windows, is caught with its site. The event list itself is
  cleared whenever recording goes off (PyTorch's allocator does that), so the history at an OOM
  holds only the window in progress, if one is.

The thread holds the GIL for ~20 us per device per check and ~2 us per switch: less than
0.01 % of a second. It never initialises CUDA (it starts from the CUDA start-up callback) and
never raises: on any failure it turns recording off and ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collectors.memory.policy import DEFAULT_BUDGET, DEFAULT_MAX_ENTRIES, OFF, HistoryPolicy, apply

log = logging.getLogger("dynprof.agent")

# Cost of recording one allocator event with the Python stack of allocations, as a fraction of a
# second: the H200 measurement (1.15-1.96 us, launch-bound loop) with a margin for deeper stacks.
EVENT_COST_S = 2.5e-6
CHECK_S = 0.5
MIN_WINDOW_S = 0.02
MAX_WINDOW_S = 0.5
MAX_PERIOD_S = 60.0


@dataclass(frozen=True)
class Plan:
    """What the controller does next, and why (shown by ``dynprof ps --json``)."""

    recording: str  # "continuous" or "windows"
    window_s: float
    period_s: float
    events_per_s: float
    estimated_cost: float  # of recording all the time, fraction of wall time
    budget: float

    @property
    def duty(self) -> float:
        if self.recording == "continuous":
            return 1.0
        return self.window_s / self.period_s if self.period_s else 0.0

    def reason(self) -> str:
        rate = f"{self.events_per_s:,.0f} allocator events/s x {EVENT_COST_S * 1e6:g} us"
        cost = f"recording all the time would cost ~{self.estimated_cost * 100:.2g} % ({rate})"
        if self.recording == "continuous":
            return f"recording all the time: {cost}, within the {self.budget * 100:g} % budget"
        return (
            f"recording {self.duty * 100:.2g} % of the time, {self.window_s * 1000:.0f} ms every "
            f"{self.period_s:.3g} s: {cost}, over the {self.budget * 100:g} % budget"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "recording": self.recording,
            "window_s": round(self.window_s, 4),
            "period_s": round(self.period_s, 4),
            "duty": round(self.duty, 5),
            "events_per_s": round(self.events_per_s, 1),
            "estimated_cost": round(self.estimated_cost, 6),
            "budget": self.budget,
            "reason": self.reason(),
        }


def plan(events_per_s: float, budget: float, step_time_s: float | None, cost_per_event_s: float = EVENT_COST_S) -> Plan:
    """The recording plan for a measured event rate (pure: the unit tests' subject)."""
    estimated = max(0.0, events_per_s) * cost_per_event_s
    if estimated <= budget:
        return Plan("continuous", 0.0, 0.0, events_per_s, estimated, budget)
    duty = budget / estimated
    window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, 1.5 * step_time_s if step_time_s else 0.05))
    period = window / duty
    if period > MAX_PERIOD_S:  # a window at least every minute: shorter windows instead
        period = MAX_PERIOD_S
        window = max(period * duty, 0.001)
        period = window / duty
    return Plan("windows", window, period, events_per_s, estimated, budget)


class AutoHistory:
    """The controller thread. ``step_time`` gives the job's recent step time (or None);
    ``on_plan`` is called with each new plan (never on the training thread)."""

    def __init__(
        self,
        budget: float = DEFAULT_BUDGET,
        step_time: Callable[[], float | None] = lambda: None,
        on_plan: Callable[[Plan], None] | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        cost_per_event_s: float = EVENT_COST_S,
    ) -> None:
        self.budget = budget
        self.step_time = step_time
        self.on_plan = on_plan
        self.cost_per_event_s = cost_per_event_s
        self.window_policy = HistoryPolicy("window", "python", max_entries)
        self.plan: Plan | None = None
        self.recording = False
        self.windows = 0
        self._stop = threading.Event()
        # Held while an OOM capture reads the allocator: no switch (which would clear the
        # event list) until it is written.
        self.hold = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._devices = 0

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dynprof-memory-auto", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the controller; recording is left off."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop --------------------------------------------------------------------------------
    def _events(self) -> int:
        import torch

        total = 0
        for device in range(self._devices):
            stats = torch._C._cuda_memoryStats(device)
            alloc = stats.get("allocation", {}).get("all", {})
            total += int(alloc.get("allocated", 0)) + int(alloc.get("freed", 0))
        return total

    def _set(self, on: bool) -> None:
        if on == self.recording:
            return
        with self.hold:
            apply(self.window_policy if on else OFF)
            self.recording = on

    def _run(self) -> None:
        try:
            import torch

            self._devices = torch.cuda.device_count()
            last_events, last_t = self._events(), time.monotonic()
            wait = CHECK_S
            while not self._stop.wait(wait):
                if os.getpid() != self._pid:
                    return  # a forked child: not ours to drive
                events, now = self._events(), time.monotonic()
                rate = (events - last_events) / max(now - last_t, 1e-6)
                last_events, last_t = events, now
                p = plan(rate, self.budget, self.step_time(), self.cost_per_event_s)
                self._publish(p)
                if p.recording == "continuous":
                    self._set(True)
                    wait = CHECK_S
                    continue
                # One window, then off for the rest of the period (checked again at its end).
                self._set(True)
                stopped = self._stop.wait(p.window_s)
                self._set(False)
                self.windows += 1
                if stopped:
                    return
                wait = max(p.period_s - p.window_s, 0.0)
        except BaseException:
            log.exception("memory history (auto) failed; recording is off")
        finally:
            try:
                if os.getpid() == self._pid:
                    self._set(False)
            except BaseException:
                pass

    def _publish(self, p: Plan) -> None:
        old = self.plan
        self.plan = p
        changed = (
            old is None
            or old.recording != p.recording
            or (p.recording == "windows" and not 0.5 <= (p.duty / max(old.duty, 1e-9)) <= 2.0)
        )
        if changed:
            log.info("memory history auto: %s", p.reason())
            if self.on_plan is not None:
                try:
                    self.on_plan(p)
                except Exception:
                    log.exception("memory history auto: reporting the plan failed")
