"""The GPU's side of a step: one CUDA event recorded at each step boundary that ran on CUDA.

A rank that does not step may wait for its GPU (the work it queued has not finished) or be
stuck on the host (its GPU finished everything and waits for work). The step hook records a
CUDA event on the current stream at each boundary, and the agent's status answer queries it
(``event.query()``, no wait), so the watch can tell the two apart.

What the hook does, only once CUDA is initialised in the process (dynprof never initialises
it) and the optimizer's parameters are on CUDA: one ``cudaStreamIsCapturing`` and one
``cudaEventRecord`` into one of two events made at the first such step and reused in turn (no
allocation per step, never a synchronize, no setting changed). It records at most once every
``MIN_GAP_S`` (10 ms) of wall time: a step that ends sooner after the last record is not
marked, so on steps of 1 ms the record's ~11 us (measured on an H200) is paid once in ten steps
(``scripts/bench_gpu_step.py``), and the look says which step the event marks. In a CUDA graph
capture it records nothing. Without CUDA it costs one ``torch.cuda.is_initialized()`` call per step
(``scripts/bench_gpu_step.py`` measures both). Any failure turns the marker off for the
process, with one log line; the training step never sees it.

**The progress probe.** Once the rank has not stepped for ``PROBE_AFTER_S``, each status answer
reports the probe recorded after the previous answer (``probe_done``: the GPU finished everything
queued on the device's default stream before it; ``probe_age_s``) and asks for a new one there:
a rank whose main thread spins in a CUDA wait while its GPU finishes work is busy (an evaluation
loop that syncs at every batch), one whose GPU has not finished work queued seconds ago waits for
its GPU. The record is made by a thread of its own (``_Prober``), never by the agent's: on an H200
(driver 580, CUDA 13) ``cudaEventCreate`` and ``cudaEventRecord`` on any stream do not return
while another thread of the process is in a copy between host and device (``.item()``, ``.cpu()``,
a pageable ``.to()``) behind a kernel that does not end, where ``cudaEventQuery`` and
``cudaStreamQuery`` return at once. A record still pending is itself the answer: the device has
not let the process queue anything for that long (reported not done, aged from the record's
start). Only where the marked steps run on the default stream (which no CUDA graph capture can
use), and only from threads whose CUDA stream-capture mode is relaxed (``_capture_relaxed``): an
event query from another thread during a global-mode capture failed 3324 of 3326 captures on
that H200; with the querying thread relaxed, 0 of 1087.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dynprof.agent")

MAX_KNOWN_OPTIMIZERS = 256
MIN_GAP_S = 0.010  # at most one record per this much wall time (see the module's docstring)
PROBE_AFTER_S = 2.0  # the progress probe runs once the last marked step is this old
CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed (driver_types.h)
NOT_RELAXED = (
    "not queried: this thread's CUDA stream-capture mode could not be set to relaxed (no libcudart "
    "loaded in the process), and a query could fail a CUDA graph capture of the job's"
)

_thread_state = threading.local()
_cudart_lib: list[Any] = []  # [the process's libcudart, or None], found once


def _cudart() -> Any:
    """The CUDA runtime library this process already loaded (never loads one), or None."""
    if not _cudart_lib:
        lib = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line and "/" in line}
            for path in sorted(paths):
                try:
                    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    break
                except OSError:
                    continue
        except OSError:
            lib = None
        _cudart_lib.append(lib)
    return _cudart_lib[0]


def _capture_relaxed() -> bool:
    """Put this thread's CUDA stream-capture mode to relaxed, once per thread: then no CUDA call
    it makes is refused, or invalidates a capture, because another thread of the job captures a
    CUDA graph in the default (global) mode. False where it could not be done."""
    done = getattr(_thread_state, "relaxed", None)
    if done is None:
        done = False
        try:
            lib = _cudart()
            if lib is not None:
                mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
                done = lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
        except Exception:
            done = False
        _thread_state.relaxed = done
    return bool(done)


@dataclass(slots=True)
class GpuStepLook:
    """What the status answer says of the latest marked step (computed when asked)."""

    recorded: bool
    step: int = 0
    done: bool = False
    age_s: float = 0.0
    device: int = -1
    device_uuid: str = ""
    note: str = ""
    coredump_armed: bool = False  # the driver's user-triggered GPU core dump is armed here
    probed: bool = False  # a progress probe is reported (see the module's docstring)
    probe_done: bool = False
    probe_age_s: float = 0.0


class GpuStepMarker:
    """The two events and what the latest one marks (see the module's docstring)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock  # time.monotonic; a test's own clock
        self.enabled = True
        self.off_reason = ""
        self._events: list[Any] = []  # two torch.cuda.Event, made at the first step on CUDA
        # [step, time.monotonic() of the record, device index, on the default stream] of each
        # event, mutated in place
        self._marks: list[list[Any]] = [[0, 0.0, -1, False], [0, 0.0, -1, False]]
        self._prober = _Prober(clock)
        self._slot = -1  # the event recorded last; -1: none yet
        self._last_record = float("-inf")  # time.monotonic() of the last record (MIN_GAP_S apart at least)
        self._on_cuda: dict[int, bool] = {}  # id(optimizer) -> its parameters are on CUDA
        self._uuids: dict[int, str] = {}

    def mark(self, torch: Any, optimizer: Any, step: int) -> None:
        """At a step boundary (the step hook). Never raises."""
        if not self.enabled or torch is None:
            return
        now = self._clock()
        if now - self._last_record < MIN_GAP_S:
            return  # a record less than MIN_GAP_S ago marks the GPU's progress well enough
        try:
            cuda = torch.cuda
            if not cuda.is_initialized():
                return
            on_cuda = self._on_cuda.get(id(optimizer))
            if on_cuda is None:
                on_cuda = self._learn(optimizer)
            if not on_cuda or cuda.is_current_stream_capturing():
                return
            stream = cuda.current_stream()
            events = self._events
            if not events:
                events = self._events = [cuda.Event(), cuda.Event()]
            slot = 1 if self._slot == 0 else 0
            events[slot].record(stream)
            mark = self._marks[slot]
            mark[0] = step
            mark[1] = now
            self._last_record = now
            mark[2] = stream.device_index
            mark[3] = stream.cuda_stream == 0  # the device's default (legacy) stream
            self._slot = slot
        except Exception as exc:  # the training step must never see our failure
            self._turn_off("recording", exc)

    def _learn(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps parameters on CUDA (its first parameter's device), once."""
        on_cuda = False
        for group in getattr(optimizer, "param_groups", ())[:64]:
            params = group.get("params") if isinstance(group, dict) else None
            if params:
                on_cuda = bool(getattr(params[0], "is_cuda", False))
                break
        if len(self._on_cuda) >= MAX_KNOWN_OPTIMIZERS:
            self._on_cuda.clear()
        self._on_cuda[id(optimizer)] = on_cuda
        return on_cuda

    def look(self, torch: Any) -> GpuStepLook:
        """The latest marked step, its event queried now (never waits). Never raises."""
        found = self._look(torch)
        found.coredump_armed = os.environ.get("CUDA_ENABLE_USER_TRIGGERED_COREDUMP") == "1"
        return found

    def _look(self, torch: Any) -> GpuStepLook:
        if not self.enabled:
            return GpuStepLook(False, note=f"off for this process: {self.off_reason}"[:300])
        slot = self._slot
        if slot < 0 or not self._events:
            return GpuStepLook(False, note="no optimizer step on CUDA yet")
        step, at, device, on_default = self._marks[slot]
        if not _capture_relaxed():
            # A CUDA call from this thread could fail a graph capture of the job's (see the
            # module's docstring): without a relaxed capture mode, the event is not queried.
            return GpuStepLook(False, note=NOT_RELAXED)
        try:
            done = bool(self._events[slot].query())
            uuid = self._uuid(torch, device)
            found = GpuStepLook(True, int(step), done, max(0.0, self._clock() - at), int(device), uuid)
            if on_default and self._clock() - at >= PROBE_AFTER_S:
                reported = self._prober.report()
                if reported is not None:
                    found.probed = True
                    found.probe_done, found.probe_age_s = reported
                self._prober.request(torch, int(device))
            else:
                self._prober.reset()  # stepping again (or no probe here): a new stall starts afresh
        except Exception as exc:
            self._turn_off("querying", exc)
            return GpuStepLook(False, note=f"off for this process: {self.off_reason}"[:300])
        return found

    def device_identity(self, torch: Any) -> dict[str, Any] | None:
        """The CUDA device of the latest marked step, ``{"index", "uuid"}`` (the UUID names the
        physical GPU whatever CUDA_VISIBLE_DEVICES says), or None before any. Never raises."""
        slot = self._slot
        if not self.enabled or slot < 0 or torch is None:
            return None
        device = int(self._marks[slot][2])
        try:
            return {"index": device, "uuid": self._uuid(torch, device)}
        except Exception:
            return None

    def _uuid(self, torch: Any, device: int) -> str:
        if device < 0 or torch is None:
            return ""
        known = self._uuids.get(device)
        if known is None:
            raw = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
            known = raw if not raw or raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"
            self._uuids[device] = known[:100]
        return known

    def _turn_off(self, doing: str, exc: BaseException) -> None:
        self.enabled = False
        self.off_reason = f"{doing} its CUDA event failed: {type(exc).__name__}: {exc}"[:300]
        log.warning("dynprof: the GPU step marker is off for this process: %s", self.off_reason)


class _Prober:
    """The progress probe's event, recorded on a daemon thread of its own (see the module's
    docstring): asked for by the agent's thread, which never waits for it."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._torch: Any = None
        self._device = -1
        self._event: Any = None
        self._recorded_at: float | None = None  # clock() when the event's last record returned
        self._recording_since: float | None = None  # a record under way since then
        self.off_reason = ""

    def request(self, torch: Any, device: int) -> None:
        """Ask for a new record (none while one is under way). Never blocks."""
        with self._lock:
            if self.off_reason or self._recording_since is not None:
                return
            self._torch, self._device = torch, device
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dynprof-gpu-probe", daemon=True)
                self._thread.start()
        self._wanted.set()

    def report(self) -> tuple[bool, float] | None:
        """(done, age_s) of the probe: a record under way is not done, aged from its start; None
        before the first record of this stall. Never blocks (``cudaEventQuery`` returns at once)."""
        with self._lock:
            since, event, at = self._recording_since, self._event, self._recorded_at
        now = self._clock()
        if since is not None:
            return False, max(0.0, now - since)
        if event is None or at is None:
            return None
        return bool(event.query()), max(0.0, now - at)

    def reset(self) -> None:
        with self._lock:
            self._recorded_at = None

    def _run(self) -> None:
        relaxed = _capture_relaxed()  # this thread's own capture mode
        while True:
            self._wanted.wait()
            self._wanted.clear()
            with self._lock:
                if not relaxed:
                    self.off_reason = "this thread's CUDA stream-capture mode could not be relaxed"
                    return
                self._recording_since = self._clock()
                torch, device = self._torch, self._device
            try:
                cuda = torch.cuda
                event = self._event if self._event is not None else cuda.Event()
                with cuda.device(device):
                    event.record(cuda.default_stream(device))
                with self._lock:
                    self._event, self._recorded_at, self._recording_since = event, self._clock(), None
            except Exception as exc:  # the probe is off; the marker and the job go on
                with self._lock:
                    self._recording_since = None
                    self.off_reason = f"recording failed: {type(exc).__name__}: {exc}"[:300]
                log.warning("dynprof: the GPU progress probe is off for this process: %s", self.off_reason)
                return
