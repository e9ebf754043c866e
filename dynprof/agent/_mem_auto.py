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

Both the read of the counters and the switch are calls into the CUDA caching allocator, which
take the allocator's lock while holding the GIL. A job's thread can hold that lock for as long
as its GPU is busy (``torch.cuda.empty_cache()`` frees cached blocks only once the work that may
use them is done; a ``cudaFree`` on the allocator's retry after an OOM does the same): a call
made then by a thread of dynprof would wait for the lock with the GIL held, and every Python
thread of the job would stop with it, dynprof's agent included (measured on an H100: a
``memory_stats`` call from a second thread during an ``empty_cache`` behind a long kernel
stopped the process's Python until the kernel ended). So the controller's thread never calls
the allocator itself: it hands each read and switch to the main thread, which runs it at its
next bytecode (CPython's pending calls), when the main thread is not inside the allocator. A
main thread in a long C call does not run it: after ``ON_MAIN_WAIT_S`` the call is cancelled,
never run late, and the controller tries again at its next check (a switch-off is retried
until it is done). Only a job whose optimizer steps run on another thread than the main one
(whose main thread may never run Python again) gets the calls on the controller's thread, as
before. A read costs the main thread ~20 us per device per check, a switch ~2 us: less than
0.01 % of a second. The controller never initialises CUDA (it starts from the CUDA start-up
callback) and never raises: on any failure it turns recording off and ends.
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
from dynprof.agent._mainthread import call_soon_in_main_thread
from dynprof.onmain import NotRun, call_on_main

log = logging.getLogger("dynprof.agent")

# Cost of recording one allocator event with the Python stack of allocations, as a fraction of a
# second: the H200 measurement (1.15-1.96 us, launch-bound loop) with a margin for deeper stacks.
EVENT_COST_S = 2.5e-6
CHECK_S = 0.5
MIN_WINDOW_S = 0.02
MAX_WINDOW_S = 0.5
MAX_PERIOD_S = 60.0
ON_MAIN_WAIT_S = 2.0  # how long an allocator call waits for the main thread to run it
_MISSED = object()  # an allocator call the main thread did not run (cancelled)


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
        trainer_thread: Callable[[], int | None] = lambda: None,
        call_on_main: Callable[[Callable[[], None]], bool] = call_soon_in_main_thread,
    ) -> None:
        self.budget = budget
        # the thread the job's optimizer steps run on (None before any) and how a call is handed
        # to the main thread (see the module's docstring)
        self.trainer_thread = trainer_thread
        self.call_on_main = call_on_main
        self.missed = 0  # allocator calls the main thread did not run in time (cancelled)
        self._stopped_by_main = False
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
        # stopped by the main thread, which waits in C below: the thread's last switch-off cannot
        # run on it and is not waited for (done below, here on the main thread)
        self._stopped_by_main = threading.current_thread() is threading.main_thread()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.recording and threading.current_thread() is threading.main_thread():
            # the main thread waited here, in C: the thread's own switch-off could not run on it
            self._switch(False)

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

    def _switch(self, on: bool) -> None:
        with self.hold:
            if on != self.recording:
                apply(self.window_policy if on else OFF)
                self.recording = on

    def _set(self, on: bool) -> bool:
        """Switch recording; whether it is now as asked (not when the main thread did not run
        the switch in time)."""
        if on == self.recording:
            return True
        self._allocator(lambda: self._switch(on))
        return on == self.recording

    def _allocator(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, a call into the CUDA caching allocator, run where it cannot stop the job's
        threads (the module's docstring): on the main thread, waited for at most
        :data:`ON_MAIN_WAIT_S` (and while the controller is not stopped); :data:`_MISSED` when it
        did not start by then (it is cancelled, never run late). On this thread when the job's
        steps run on another thread than the main one."""
        main = threading.main_thread()
        trainer = self.trainer_thread()
        if (trainer is not None and trainer != main.ident) or not main.is_alive():
            return fn()
        try:
            return call_on_main(
                self.call_on_main, fn, ON_MAIN_WAIT_S, give_up=lambda: self._stop.is_set() and self._stopped_by_main
            )
        except NotRun:
            self.missed += 1
            return _MISSED

    def _run(self) -> None:
        try:
            import torch

            self._devices = torch.cuda.device_count()
            last: tuple[int, float] | None = None  # the counters' last read, and when
            wait = 0.0
            while not self._stop.wait(wait):
                if os.getpid() != self._pid:
                    return  # a forked child: not ours to drive
                wait = CHECK_S
                if self.recording and (self.plan is None or self.plan.recording != "continuous"):
                    self._set(False)  # a window's switch-off that did not run: again until it does
                    continue
                events, now = self._allocator(self._events), time.monotonic()
                if events is _MISSED:
                    continue  # the rate spans the gap at the next read
                if last is None:
                    last = events, now
                    continue
                rate = (events - last[0]) / max(now - last[1], 1e-6)
                last = events, now
                p = plan(rate, self.budget, self.step_time(), self.cost_per_event_s)
                self._publish(p)
                if p.recording == "continuous":
                    self._set(True)
                    continue
                # One window, then off for the rest of the period (checked again at its end).
                if not self._set(True):
                    continue
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
