"""One rank's state in a look, from its two stack samples and its progress rows (the table of
states is :mod:`dynprof.watch.detect`'s): :func:`classify` puts a :class:`RankLook` in one
:class:`RankState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.stacks import Frame, ProcessStacks, short_path
from dynprof.watch import gpu_side
from dynprof.watch.frames import (
    GpuWait,
    collective_of,
    gpu_wait_of,
    in_communication_api,
    is_communication_frame,
    main_frames,
    native_frame,
    py_key,
    python_frames,
    user_frame,
    where,
)
from dynprof.watch.model import RankProgress
from dynprof.watch.stall import EXITED_STATES, rank_age

MOVING_CPU_S = 0.1  # CPU seconds (with children) between the samples that make a rank "moving"
# Bytes read or written (with children) between the samples that make a rank "moving": far
# above what its agent's status answers cost (a few kB), a checkpoint's or a loader's writes.
MOVING_IO_BYTES = 1 << 20

STATES = ("stopped", "waiting", "waiting-gpu", "in-gpu-library", "in-c", "moving", "parked", "unread", "gone")


# -- one rank ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RankLook:
    """What the look saw of one rank: its progress before and after, its two stack samples."""

    node: str  # the node's label
    before: RankProgress
    after: RankProgress | None  # None: the rank was not in the second progress read
    first: ProcessStacks | None = None
    second: ProcessStacks | None = None
    unread: str | None = None  # why the stacks could not be read

    @property
    def rank(self) -> int | None:
        return self.before.rank

    @property
    def pid(self) -> int:
        return self.before.pid


@dataclass(slots=True)
class RankState:
    node: str
    rank: int | None
    pid: int
    step: int | None  # None: its agent does not answer and its step count was never heard
    age_s: float | None
    state: str  # one of STATES
    where: str  # the frame that says where it is
    collective: str | None = None
    cpu_delta_s: float | None = None
    span_s: float = 0.0
    detail: str = ""
    stack_key: tuple[Any, ...] = ()  # the Python stack of the second sample (the wait's identity)
    frames: list[Frame] = field(default_factory=list)  # the main thread's stack, innermost first
    gpu_call: str = ""  # waiting-gpu: what it waits in, in words ("a device-to-host copy (Tensor.cpu at train.py:37)")
    gpu_evidence: str = ""  # waiting-gpu, in-gpu-library: what its GPU's side said ("GPU 0 busy (100 %), ...")
    io_delta_b: int | None = None  # bytes read and written across the look, its children's included
    moved_by: tuple[str, ...] = ()  # moving: what it was seen doing ("cpu", "io", "disk", "stack")

    @property
    def who(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"

    def row(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.node,
            "pid": self.pid,
            "step": self.step,
            "last_step_age_s": None if self.age_s is None else round(self.age_s, 3),
            "state": self.describe(),
            "where": self.where,
            "cpu_delta_s": None if self.cpu_delta_s is None else round(self.cpu_delta_s, 3),
        }

    def describe(self) -> str:
        if self.state == "waiting":
            return f"waiting in {self.collective}"
        if self.state == "waiting-gpu":
            return f"waiting for its GPU in {self.gpu_call}"
        if self.state == "in-gpu-library":
            return f"held on the host in {self.gpu_call} (its GPU idle, its work finished)"
        return self.state


def classify(look: RankLook, moving_cpu_s: float = MOVING_CPU_S) -> RankState:
    """The state of one rank from its look (see the module's table)."""
    before, after = look.before, look.after
    last = after or before
    frames2 = main_frames(look.second)
    frames1 = main_frames(look.first)
    frames = frames2 or frames1
    cpu_delta: float | None = None
    io_delta: int | None = None
    span = 0.0
    if after is not None and after.polled_at > before.polled_at:  # two reads, not one poll seen twice
        span = after.polled_at - before.polled_at
        if before.cpu_s is not None and after.cpu_s is not None:
            cpu_delta = max(0.0, after.cpu_s - before.cpu_s)
        if before.io_bytes is not None and after.io_bytes is not None:
            io_delta = max(0, after.io_bytes - before.io_bytes)
    state = RankState(
        node=look.node,
        rank=before.rank,
        pid=before.pid,
        step=None if last.step_unknown else last.step,
        age_s=None if last.step_unknown else rank_age(last),
        state="unread",
        where=where(user_frame(frames) or native_frame(frames)),
        cpu_delta_s=cpu_delta,
        io_delta_b=io_delta,
        span_s=span,
        stack_key=py_key(frames),
        frames=frames,
    )
    if after is None or last.process_state in EXITED_STATES:
        state.state = "gone"
        state.detail = "the process is gone"
        return state
    if before.process_state == "stopped" or last.process_state == "stopped":
        state.state = "stopped"
        state.detail = "stopped (process state T: SIGSTOP or a debugger)"
        return state
    spent = cpu_delta is not None and cpu_delta >= moving_cpu_s
    disk_sleep = "disk-sleep" in (before.process_state, last.process_state)
    in_io = disk_sleep or (io_delta is not None and io_delta >= MOVING_IO_BYTES)
    changed = bool(frames1 and frames2) and py_key(frames1) != py_key(frames2)
    held = _held_in_gpu_library(frames1, frames2, changed, before, last)
    if held is not None:
        _say_gpu_wait(state, held, frames, gpu_side.agreement(last))
        return state
    c1, c2 = collective_of(frames1), collective_of(frames2)
    # inside communication code natively: a wait that spins the CPU (MPI's progress loop, a
    # busy-polling transport) still waits
    native_wait = any(is_communication_frame(f) for f in frames2)
    if c1 is None and c2 is not None and native_wait and not changed and collective_of(python_frames(frames2)) is None:
        # read natively the second time only: the same Python frame, now seen in a native wait
        c1 = c2
    if c1 and c2 and c1 == c2 and not changed and (not spent or native_wait):
        state.state = "waiting"
        state.collective = c2
        inner = native_frame(frames)
        if inner is not None and not any(in_communication_api(f) for f in frames):
            py = user_frame(frames)  # a wait seen in C only (a CUDA synchronize): its native frame says it
            state.where = f"{where(py)} [native: {where(inner)}]" if py is not None else where(inner)
        return state
    holds_gil = _holds_gil(look.second) or _holds_gil(look.first)
    unresponsive = last.agent == "unresponsive" or before.agent == "unresponsive"
    # In C holding the GIL, and not working there (no CPU, the same Python frame): a rank that
    # imports torch or compiles holds the GIL too, but it moves.
    if unresponsive and (holds_gil or (frames and frames[0].native)) and not (spent or changed or in_io):
        state.state = "in-c"
        inner = native_frame(frames)
        if inner is not None:
            py = user_frame(frames)
            state.where = f"{where(py)} [native: {where(inner)}]" if py is not None else where(inner)
        state.detail = "in C code holding the GIL (its agent does not answer)"
        return state
    if changed or spent or in_io:
        state.state = "moving"
        parts = []
        if cpu_delta is not None:
            parts.append(f"CPU +{cpu_delta:.1f} s in {span:.1f} s")
        if io_delta is not None and io_delta >= MOVING_IO_BYTES:
            parts.append(f"I/O +{io_delta / 1e6:.1f} MB")
        if disk_sleep:
            parts.append("in disk I/O (process state D)")
        if changed:
            parts.append("stack changed")
        state.detail = "moving (" + ", ".join(parts) + ")"
        state.moved_by = tuple(
            kind
            for kind, seen in (
                ("cpu", spent),
                ("io", io_delta is not None and io_delta >= MOVING_IO_BYTES),
                ("disk", disk_sleep),
                ("stack", changed),
            )
            if seen
        )
        return state
    if frames:
        state.state = "parked"
        if cpu_delta is None:
            state.detail = "parked: the same frame in both samples (its CPU not measured)"
        else:
            state.detail = "parked: the same frame in both samples, no CPU"
        return state
    state.detail = f"stacks unreadable ({look.unread})" if look.unread else "stacks unreadable"
    return state


def _has_native(frames: Sequence[Frame]) -> bool:
    return any(f.native for f in frames)


def _held_in_gpu_library(
    frames1: Sequence[Frame], frames2: Sequence[Frame], changed: bool, before: RankProgress, last: RankProgress
) -> GpuWait | None:
    """The GPU call a rank is held in, when its samples show one: its main thread inside a GPU
    library in both samples (a first sample read in Python only counts by its Python frames,
    which must be the second's), the same Python frames, no step made meanwhile, and no
    torch.distributed collective's Python frame (that rank waits in the collective: "waiting").
    A call that has not returned across the look is one the rank is held in, whatever its
    symbol: a launch that does not return waits for a full queue, a copy for the work before it."""
    if changed or not frames1 or not frames2 or last.step != before.step:
        return None
    second = gpu_wait_of(frames2)
    if second is None or collective_of(python_frames(frames2)) is not None:
        return None
    if _has_native(frames1) and gpu_wait_of(frames1) is None:
        return None  # seen natively elsewhere the first time: not one call across the look
    return second


def _say_gpu_wait(state: RankState, held: GpuWait, frames: Sequence[Frame], side: gpu_side.Agreement) -> None:
    """Put a rank held in a GPU call in its state: ``waiting-gpu`` when its GPU's side agrees (work
    queued and unfinished, or the device busy) or says nothing (the stack alone, said so);
    ``in-gpu-library`` when its GPU's side disagrees (the device idle, its work done): the call
    does not wait for the device, but for something on the host (a lock in the library, a peer
    process, the OS), and the verdict says both."""
    py = user_frame(frames)
    state.where = f"{where(py)} [native: {where(held.frame)}]" if py is not None else where(held.frame)
    at = f"{short_path(py.file)}:{py.line}" if py is not None else where(held.frame)
    state.gpu_call = f"{held.call} ({held.op} at {at})" if held.op else f"{held.call} (at {at})"
    state.gpu_evidence = side.evidence
    if side.agrees is False:
        state.state = "in-gpu-library"
        state.detail = (
            f"held in {state.gpu_call} across the look, but its GPU has nothing to wait for "
            f"({side.evidence}): the call waits on the host (a lock in {held.library}, a peer process, the OS), "
            "not on the device"
        )
        return
    state.state = "waiting-gpu"
    if side.agrees:
        state.detail = f"waits for its GPU in {state.gpu_call}; its GPU agrees: {side.evidence}"
    else:
        state.detail = f"waits for its GPU in {state.gpu_call}; judged from its stack alone: {side.evidence}"


def _holds_gil(p: ProcessStacks | None) -> bool:
    if p is None:
        return False
    main = p.main_thread()
    return bool(main is not None and main.holds_gil)
