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
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dynprof.agent")

MAX_KNOWN_OPTIMIZERS = 256
MIN_GAP_S = 0.010  # at most one record per this much wall time (see the module's docstring)


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


class GpuStepMarker:
    """The two events and what the latest one marks (see the module's docstring)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock  # time.monotonic; a test's own clock
        self.enabled = True
        self.off_reason = ""
        self._events: list[Any] = []  # two torch.cuda.Event, made at the first step on CUDA
        # [step, time.monotonic() of the record, device index] of each event, mutated in place
        self._marks: list[list[Any]] = [[0, 0.0, -1], [0, 0.0, -1]]
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
        step, at, device = self._marks[slot]
        try:
            done = bool(self._events[slot].query())
            uuid = self._uuid(torch, device)
        except Exception as exc:
            self._turn_off("querying", exc)
            return GpuStepLook(False, note=f"off for this process: {self.off_reason}"[:300])
        return GpuStepLook(True, int(step), done, max(0.0, self._clock() - at), int(device), uuid)

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
