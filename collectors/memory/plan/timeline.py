"""The measured step's memory *timeline*: the live bytes after every operator, cut into segments
at each block event, each segment keeping its highest level (apart for the operators run while
autocast's cache is on), set right against the allocator's count on CUDA.

:class:`StepTimeline` is the part of :class:`collectors.memory.plan.capture.StepMeasurement`
that keeps it: the meter's callbacks (:meth:`~StepTimeline._on_op`, ``_on_new``, ``_on_free``),
the segments (:meth:`~StepTimeline._event`), the clocks and the calibration against the
allocator. Imports no torch until asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectors.memory.plan.measurement import MAX_KEPT, MAX_SEGMENTS
from collectors.memory.plan.meter import LiveTensorBytes

MAX_STORAGES = 5_000_000  # storages whose birth and release are kept (then no more: less is freed)


class StepTimeline:
    """The timeline's state and its keeping, for :class:`~collectors.memory.plan.capture.StepMeasurement`."""

    # set by StepMeasurement.__init__ (the step's hooks read and write them too)
    clock: Callable[[], float]
    reset_peak: bool
    allocator: Callable[[], tuple[int, int]] | None
    started: bool
    stopped: bool
    error: str
    _meter: LiveTensorBytes | None
    _cuda: Any
    _device: str
    _amp: Callable[[], bool]
    _plain: list[int]
    _cached: list[int]
    _offset: int
    _calibrated: bool
    _drift: int
    _drift_over: int
    _blk_max: int
    _born: dict[tuple[int, int], int]
    _input_of: dict[tuple[int, int], set[int]]
    _bwd_start: list[int]
    _kept: list[list[tuple[int, int, int]]]
    _kept_groups: int
    _deaths: list[tuple[int, list[int]]]
    _hook_s: float
    _per_op_s: float

    def _level(self) -> int:
        meter = self._meter
        return self._offset + (meter.current if meter is not None else 0)

    def _recalibrate(self) -> None:
        """On CUDA, set the level right against the allocator's count (what no operator's
        outputs show: persistent workspaces, storages freed that were made before); how far it
        had drifted since the last event is kept (the plan's margin). Where the peak statistic
        may be reset (the caller's own process), the allocator's peak since the last event is
        the closing segment's highest level, kernels' workspaces included, and is reset."""
        if self.allocator is None or self._meter is None:
            return
        try:
            allocated, high = self.allocator()
            offset = allocated - self._meter.current
            if self._calibrated:
                # the allocator holds more than the levels counted: memory no operator returned
                # was made (the levels since the last event may have been low by it); less: a
                # storage the meter did not follow died (they were high by it)
                if offset > self._offset:
                    self._drift = max(self._drift, offset - self._offset)
                else:
                    self._drift_over = max(self._drift_over, self._offset - offset)
            self._calibrated = True
            self._offset = offset
            if self.reset_peak and self._cuda is not None:
                seg = len(self._plain) - 1
                if self._plain[seg] >= self._cached[seg]:
                    self._plain[seg] = max(self._plain[seg], high)
                else:
                    self._cached[seg] = max(self._cached[seg], high)
                self._cuda.reset_peak_memory_stats(self._device)
        except Exception as exc:
            self.error = self.error or f"allocator statistics: {exc}"

    def _cuda_allocated(self) -> tuple[int, int]:
        """The CUDA allocator's count of this device's bytes: (now, highest since its reset)."""
        stats = self._cuda.memory_stats(self._device)
        return int(stats.get("allocated_bytes.all.current", 0)), int(stats.get("allocated_bytes.all.peak", 0))

    def _on_op(self, current: int) -> None:
        level = self._offset + current
        seg = len(self._plain) - 1
        if level > self._plain[seg] or level > self._cached[seg]:  # autocast asked only then
            if self._amp():
                if level > self._cached[seg]:
                    self._cached[seg] = level
            elif level > self._plain[seg]:
                self._plain[seg] = level
        if level > self._blk_max:
            self._blk_max = level

    def _on_new(self, address: int, size: int) -> None:
        if len(self._born) < MAX_STORAGES:
            self._born[(address, size)] = len(self._plain) - 1

    def _on_free(self, address: int, size: int) -> None:
        """A storage died. When it was an input of blocks whose backward has not begun, a
        checkpoint of any of them would have kept it until its backward (a non-reentrant
        checkpoint keeps its inputs to recompute from): a segment begins before the next
        operator (or at the next block event), from which those blocks' checkpoints hold it.
        Called from the storage's weak reference, before its memory is released: the segment
        is not begun here, where the allocator's count still holds it."""
        if self.stopped or not self.started:
            return
        users = self._input_of.pop((address, size), None)
        if not users:
            return
        waiting = sorted(j for j in users if self._bwd_start[j] < 0 and len(self._kept[j]) < MAX_KEPT)
        if waiting and self._meter is not None:
            self._deaths.append((size, waiting))
            self._meter.cut = True

    def _event(self) -> int:
        """A new segment begins (at a block's forward start or end, or backward start, when
        autograd lets go of a tensor a block saved too, before the first operator after a block
        input died): its index."""
        if len(self._plain) >= MAX_SEGMENTS:
            self.error = self.error or "the step has too many block events; its timeline is cut"
        else:
            self._recalibrate()
            level = self._level()
            if self._amp():
                self._plain.append(0)
                self._cached.append(level)
            else:
                self._plain.append(level)
                self._cached.append(0)
        seg = len(self._plain) - 1
        if self._meter is not None:
            self._meter.cut = False
        while self._deaths:
            # block inputs that died since the last event or operator: kept from here
            size, waiting = self._deaths.pop(0)
            group = self._kept_groups
            self._kept_groups += 1
            for j in waiting:
                self._kept[j].append((seg, size, group))
        return seg

    def _stamp(self) -> Any:
        if self._cuda is not None:
            ev = self._cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self._cpu_now()

    def _cpu_now(self) -> float:
        """The CPU clock less what the measurement itself has cost so far (its saved-tensor hook,
        and each operator's trip through the dispatch mode, as calibrated at the start), so that a
        block's time is what it costs without the measurement."""
        ops = self._meter.ops if self._meter is not None else 0
        return self.clock() - self._hook_s - ops * self._per_op_s

    def _calibrate(self) -> None:
        """On the CPU: what one operator's trip through the dispatch mode costs (the median of
        five rounds of 64 small additions, with the mode and without)."""
        import statistics

        import torch

        a = torch.zeros(4)
        rounds = []
        probe = LiveTensorBytes(on_op=lambda current: None)
        for _ in range(5):
            t0 = self.clock()
            for _ in range(64):
                torch.add(a, 1)
            t1 = self.clock()
            with probe:
                for _ in range(64):
                    torch.add(a, 1)
            t2 = self.clock()
            rounds.append(((t2 - t1) - (t1 - t0)) / 64)
        probe.close()
        self._per_op_s = max(0.0, statistics.median(rounds))
