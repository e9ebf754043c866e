"""Each block's forward time in the job's own steps, for the plan's recompute cost.

Why not the measured step's: that step runs every operator through the meter's dispatch mode
and every saved tensor through its hook, both in Python. On a GPU whose work the CPU launches
fast enough only with plain Python, the kernels then wait for their launches and a block's
events measure the launches' pace, not the kernels' (on an H100 the measured steps ran
14-49 % slower than plain ones, and the plans over-predicted their added time by 26-46 %). A
checkpoint's recompute runs the block's plain forward, so its cost is the block's plain forward
time: :class:`BlockTimer` times it in the steps just before the measured one, with a forward
pre-hook and a forward hook per block and nothing else (on CUDA two events per call on the
current stream; on the CPU the clock), and takes the median per call over those steps. One step
of one block is one sample of a noisy clock; the median of several steps is what makes two plans
of the same job agree.

Only forwards that build a graph are timed: with grad on, outside a backward (a checkpoint's own
recompute is not the forward the job runs), outside inference mode. As the measured step does, the
timer ends itself, on the training thread, at the first block forward that shows its steps are not
coming: one without grad outside a backward and a checkpoint (an evaluation, or the job's training
is over), or one past ``time_limit_s`` since the timer began; ``on_end`` is told why.

The hooks are installed and removed on the training thread (the step listener); any thread may
read :meth:`BlockTimer.per_call_s` once the timer is stopped: it reads plain numbers and
dynprof's own CUDA events. Imports no torch until asked.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

TIMED_STEPS = 3  # the plain steps timed before the measured one
MAX_CALLS = 100_000  # calls timed in all, then no more (a model of many tiny blocks called often)


def on_cuda(blocks: list[tuple[str, Any]]) -> bool:
    """Whether the blocks' parameters are on a CUDA device (their forward then runs there)."""
    for _name, module in blocks:
        for p in module.parameters():
            return bool(p.device.type == "cuda")
    return False


def in_checkpoint(depth: int = 48) -> bool:
    """Whether an activation-checkpointing function is on the calling thread's stack
    (``torch.utils.checkpoint``, DeepSpeed's ``checkpointing.py``: a file named so)."""
    import os
    import sys

    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        if "checkpoint" in os.path.basename(frame.f_code.co_filename):
            return True
        frame = frame.f_back  # type: ignore[assignment]
        depth -= 1
    return False


def remove_hooks(handles: list[Any]) -> None:
    """Remove each of the hooks' ``handles``; one that fails does not keep the others on."""
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass


def not_the_step(t0: float, time_limit_s: float | None, since: str, what: str) -> str:
    """Why a block forward about to run says the step dynprof watches (``what``, begun at
    ``t0``) is not coming to its end, or ``""``: a forward without grad saves nothing for a
    backward (an evaluation, or the job past its last optimizer step), and a step past
    ``time_limit_s`` is not coming to its end. A checkpoint's recompute inside backward and a
    reentrant checkpoint's first forward (without grad by design) are part of the step."""
    import torch

    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        if torch._C._current_graph_task_id() == -1 and not in_checkpoint():
            return (
                "a forward ran without grad before the step's optimizer step (an evaluation, or the job's "
                f"training is over); {what} was removed"
            )
    if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
        return f"no optimizer step within {time_limit_s:.0f} s {since}; {what} was removed"
    return ""


class BlockTimer:
    """Times the forward of each of ``blocks`` ((name, module) pairs) in plain steps."""

    def __init__(
        self,
        blocks: list[tuple[str, Any]],
        cuda: bool,
        clock: Callable[[], float] | None = None,
        time_limit_s: float | None = None,
        on_end: Callable[[str], None] | None = None,
    ) -> None:
        self.names = [name for name, _module in blocks]
        self._modules: list[Any] = [module for _name, module in blocks]
        self._cuda = cuda
        self.clock = clock or time.perf_counter
        self._handles: list[Any] = []
        self._open: list[list[Any]] = [[] for _ in blocks]  # per block: starts of calls not yet ended
        self._step: list[list[tuple[Any, Any]]] = [[] for _ in blocks]  # this step's (start, end) per block
        self._done: list[list[tuple[Any, Any]]] = [[] for _ in blocks]  # complete steps' calls
        self._calls = 0
        self.steps = 0  # complete steps timed
        self.active = False  # any thread may clear it: the hooks then pass everything through
        self.error = ""
        self.time_limit_s = time_limit_s
        self.on_end = on_end
        self.ended_early = ""
        self._t0 = time.perf_counter()

    # -- the training thread -----------------------------------------------------------------
    def start(self) -> None:
        self._t0 = time.perf_counter()
        for index, module in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(self._pre(index)))
            self._handles.append(module.register_forward_hook(self._post(index), always_call=True))
        self.active = True

    def boundary(self) -> None:
        """A step boundary: the calls since the last one are a complete step's."""
        if not self.active:
            return
        for index, calls in enumerate(self._step):
            self._done[index].extend(calls)
            self._step[index] = []
            self._open[index] = []
        self.steps += 1

    def stop(self) -> None:
        """Remove the hooks and let go of the modules (safe to call twice)."""
        self.active = False
        handles, self._handles = self._handles, []
        remove_hooks(handles)
        self._modules = []
        self._open = [[] for _ in self.names]
        self._step = [[] for _ in self.names]

    def _now(self) -> Any:
        if self._cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return self.clock()

    def _timed(self) -> bool:
        import torch

        return (
            self.active
            and self._calls < MAX_CALLS
            and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and torch._C._current_graph_task_id() == -1
        )

    def _not_the_step(self) -> str:
        """Why the forward about to run says the timed steps are not coming (empty when not)."""
        return not_the_step(self._t0, self.time_limit_s, "of the timer's start", "the blocks' timer")

    def _end_early(self, why: str) -> None:
        """End from inside a forward pre-hook, on the training thread (torch iterates a copy of
        the hook tables there, so the hooks may be removed)."""
        self.ended_early = why
        self.stop()
        if self.on_end is not None:
            try:
                self.on_end(why)
            except Exception as exc:
                self.error = self.error or f"ending the timer: {exc}"

    def _pre(self, index: int) -> Callable[..., None]:
        def pre(module: Any, args: Any) -> None:
            if not self.active:
                return
            try:
                why = self._not_the_step()
                if why:
                    self._end_early(why)
                elif self._timed():
                    self._open[index].append(self._now())
            except Exception as exc:
                self.error = self.error or f"forward pre-hook: {exc}"

        return pre

    def _post(self, index: int) -> Callable[..., None]:
        def post(module: Any, args: Any, output: Any) -> None:
            try:
                if self.active and self._open[index]:
                    start = self._open[index].pop()
                    self._step[index].append((start, self._now()))
                    self._calls += 1
            except Exception as exc:
                self.error = self.error or f"forward hook: {exc}"

        return post

    # -- any thread, once stopped ------------------------------------------------------------
    def timed_calls(self) -> dict[str, int]:
        """Each block's forward calls timed in the complete steps."""
        return {name: len(calls) for name, calls in zip(self.names, self._done)}

    def per_call_s(self, timeout_s: float = 120.0) -> dict[str, float]:
        """Each timed block's median seconds per forward call over the complete steps (blocks
        with no call timed are left out). On CUDA it waits, polling, for the GPU to run past the
        last event, at most ``timeout_s``."""
        if self._cuda:
            ends = [end for calls in self._done for _start, end in calls]
            deadline = time.monotonic() + timeout_s
            while not all(ev.query() for ev in ends):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the GPU did not finish the timed steps' work within {timeout_s:.0f} s")
                time.sleep(0.01)
        out: dict[str, float] = {}
        for name, calls in zip(self.names, self._done):
            if not calls:
                continue
            if self._cuda:
                times = [start.elapsed_time(end) / 1000.0 for start, end in calls]
            else:
                times = [end - start for start, end in calls]
            out[name] = max(0.0, statistics.median(times))
        return out


def apply_timer(measurement: Any, timer: BlockTimer) -> None:
    """Give a stopped measurement the timer's figures (plain data and dynprof's own events, once
    the GPU has run past them): each block's seconds per call and the steps timed, and, where a
    hook of the timer failed, a note saying so (the blocks it missed keep the measured step's
    times)."""
    if timer.steps:
        measurement.timed, measurement.timed_steps = timer.per_call_s(), timer.steps
    if timer.error:
        measurement.notes.append(
            f"timing the blocks' forward in plain steps failed in part ({timer.error[:200]}); a block it did not "
            "time keeps the measured step's own time"
        )
