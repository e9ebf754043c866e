"""The watch's decisions, as pure functions of what it read: is the job stalled, and when it
is, what each rank is doing and what that makes of the job (a hang, with its culprits, or busy).

Nothing here reads a process or a node: :mod:`dynprof.watch.engine` gathers the progress rows
(:class:`~dynprof.watch.model.RankProgress`) and two samples of every rank's stacks (merged by
:func:`collectors.stacks.merge`), and hands them here.

**Stall.** No rank advanced for ``stall_after`` seconds (default: the larger of 60 s and 20x
the job's median step time). A rank's age is the time since its last step; before its first
step (compiling, warming up a dataloader, joining the process group) it is the time since its
process started. The job's age is the smallest rank age: one rank that stepped recently is
enough to say the job moves. A rank whose agent does not answer is put at the last step the
watch heard of (the engine keeps it); when none was ever heard its step and age are None in
the verdict, never 0 and never its process's age.

**The look.** Each rank is put in one state from its two samples and its progress rows:

=========== ==========================================================================
stopped     the process is stopped (SIGSTOP, a debugger): it cannot run at all
waiting     inside communication code in both samples, the same collective and stack, and no
            CPU spent meanwhile: in torch.distributed's communication API in Python, or
            natively in a communication library (NCCL, RCCL, gloo, MPI, UCC, by shared
            object) or torch's c10d/gloo code (by namespace), whatever the call's name (a wait
            that spins the CPU, MPI's progress loop, counts when a native frame is inside it)
waiting-gpu its main thread is inside a GPU library (the driver, the runtime, torch's CUDA
            parts, NCCL, cuBLAS, cuDNN: decided by the native frame's library, never by its
            symbol, which a stripped library names by the nearest export) in both samples,
            with the same Python frames and no step made: a call that did not return across
            the look; and its GPU's side agrees (work queued and unfinished, or the device
            busy) or was not read. Whatever CPU its spin costs, it waits for its GPU, it does
            not move. The call's family (a copy, a synchronize, a launch behind a full queue,
            or "a call into the CUDA driver" where no symbol says) only words the verdict
in-gpu-library the same, but its GPU's side disagrees (the device idle, its work done): the
            call waits on the host (a lock in the library, a peer process), and says both
in-c        its agent does not answer, it is in C code holding the GIL (py-spy says
            so, or the innermost frames are native), and it does not move
moving      its Python stack changed between the samples, it spent CPU, or it read or wrote
            (1 MiB or more, or it was in disk I/O, state D: a checkpoint on a slow
            file system) -- its children's included (DataLoader workers) -- it works at
            something that is not a step
parked      the same Python frame in both samples and no CPU: it waits for something
unread      no stack could be read, and no CPU spent: nothing says what it does
=========== ==========================================================================

Every rule states what it measures; :func:`collective_of`, :func:`meets_only`,
:func:`flight_recorder_reading`, :func:`stall_after_for` and the busy text (what was measured of
each group) say each one's reason and evidence, and docs/watch.md ("How the watch decides")
lists them.

**The decision.** Ranks wait in a collective while others do not: a **hang**, whose culprits
are the ranks that do not wait (a rank that waits for its GPU is one: it is held by its
device, not by its peers). Every rank waits for its GPU: a hang on the devices (a GPU kernel
or a collective inside NCCL), called once confirmed like a hang whose culprits move. Every rank waits and none moves: a **hang**; the culprits are
the ranks the flight recorder says never enqueued the collective the others wait in, else the
ranks whose wait differs from the largest group's (another collective, another call site).
Where the waits are in different places, the evidence of their positions comes first, never a
rank's number: the ranks in a barrier (any provider's: it carries no data, it only meets the
others) while the others wait in a collective that carries data (they left the loop the others
are in); with as many ranks in one wait as in another, the ranks with
fewer steps (they are behind), and with neither evidence the verdict says every position and
names no rank.
No rank waits and some rank moves: **busy** ("no step for 94 s: all ranks in save_checkpoint
(train.py:210), moving (CPU +1.2-1.5 s in 3.0 s, I/O +8.0 MB)": what was measured of each group),
never a hang. A rank stopped or stuck in C holding the GIL is a
culprit of a **hang** wherever the others are. When the only culprits are ranks that move (a
rank that spins, or saves a checkpoint alone while the others wait), the hang is called only
once the waiting ranks have been seen waiting in the same place for ``confirm_s`` (the engine
keeps that time across looks): a rank that saves alone for a few seconds while others wait at
a barrier is not a hang. So is a hang where no rank waits in a collective and none moves: one
look without CPU is also what a node starved of CPU shows, so the same ranks must still be in
the same places ``confirm_s`` later.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from collectors.stacks import Frame, ProcessStacks, is_library_path, short_path
from dynprof.watch import gpu_side
from dynprof.watch.model import MAX_CULPRITS, Culprit, RankProgress

DEFAULT_MIN_STALL_S = 60.0  # the least stall time (see "stall" below)
STALL_STEP_FACTOR = 20.0  # the stall time, in the job's median step times
MOVING_CPU_S = 0.1  # CPU seconds (with children) between the samples that make a rank "moving"
# Bytes read or written (with children) between the samples that make a rank "moving": far
# above what its agent's status answers cost (a few kB), a checkpoint's or a loader's writes.
MOVING_IO_BYTES = 1 << 20

# -- waiting in a collective: decided by where the main thread is, never by a list of calls ----------
# A rank waits in a collective when its main thread is inside the code that talks to its peers,
# and that is known by where the code lives, whatever the call is named (a new collective, a
# custom backend's op, a stripped library's address):
# - natively, a frame of a communication library, known by its shared object (NCCL, RCCL, gloo,
#   MPI, UCC: libnccl*, librccl*, libgloo*, libmpi*, libmpich*, libucc*), or of torch's own
#   communication code linked into libtorch, known by its C++ namespace (c10d::, gloo::: torch's
#   libraries keep their symbols);
# - in Python, a frame of torch.distributed's communication API: the process-group API
#   (torch/distributed/distributed_c10d.py, where every collective, point-to-point call and
#   barrier is defined) and the functional collectives (torch/distributed/_functional_collectives*.py,
#   their waits). The rest of torch.distributed (checkpointing, FSDP's bookkeeping, elastic) is
#   judged by what it does, like any code: a checkpoint writing through it works, it does not wait.
_COMMUNICATION_LIBRARY = re.compile(r"^lib(nccl|rccl|gloo|mpi|mpich|ucc)([._-]|$)")
_COMMUNICATION_NAMESPACES = ("c10d::", "gloo::")
_COMMUNICATION_API = re.compile(r"torch/distributed/(distributed_c10d|_functional_collectives\w*)\.py$")
# torch's Python bindings: the frame that called the communication code, not a part of it.
_BINDINGS_LIBRARY = "libtorch_python"
# A symbol in one of them: its own namespace, not a template argument (``c10::impl::...<c10d::...>``
# is the dispatcher's code); torch's bindings put theirs under torch::distributed::.
_COMMUNICATION_NAMESPACE = re.compile(
    r"^(torch::distributed::)?(" + "|".join(re.escape(n[:-2]) for n in _COMMUNICATION_NAMESPACES) + r")::"
)
_SYSTEM_LIBS = ("libc.", "libc-", "libpthread", "ld-linux", "libgcc", "libpython", "python", "libffi", "_ctypes")

STATES = ("stopped", "waiting", "waiting-gpu", "in-gpu-library", "in-c", "moving", "parked", "unread", "gone")


# -- stall -------------------------------------------------------------------------------------------
# A job stalls when no rank has made a step for far longer than its steps take: the measure is the
# job's own rhythm, ``STALL_STEP_FACTOR`` times its median step time (a step 20 times the median is
# no slow step, while the pauses a healthy job makes between steps, a log flush, a short
# evaluation, a checkpoint, last a few steps' time), never under ``DEFAULT_MIN_STALL_S`` (a job of
# fast steps pauses for seconds too: a garbage collection, a DataLoader's refill, a first
# compilation). The evidence is each rank's mean step time, as its agent measures it; with none
# known, the floor. The watch and the sidecar (its metrics, its page) use this one rule.
def median_step_time(rows: Sequence[RankProgress]) -> float:
    """The job's median step time over ranks that know theirs; 0 when none does."""
    times = [r.step_time_s for r in rows if r.step_time_s > 0]
    return float(statistics.median(times)) if times else 0.0


def stall_after_for(step_times: Sequence[float], given: float | None = None) -> float:
    """The stall time of a job whose ranks' step times are ``step_times`` (0: not known):
    ``given`` (``--stall-after``) when set, else the larger of ``DEFAULT_MIN_STALL_S`` and
    ``STALL_STEP_FACTOR`` times their median (see above)."""
    if given is not None:
        return given
    known = [t for t in step_times if t > 0]
    median = float(statistics.median(known)) if known else 0.0
    return max(DEFAULT_MIN_STALL_S, STALL_STEP_FACTOR * median)


def default_stall_after(rows: Sequence[RankProgress]) -> float:
    """The stall time of the job of ``rows`` (see :func:`stall_after_for`)."""
    return stall_after_for([r.step_time_s for r in rows])


def rank_age(row: RankProgress) -> float | None:
    """Seconds since the rank last stepped; before its first step, since its process started
    (both on the node's clock); None when neither is known."""
    if row.step > 0 and row.last_step_age_s is not None:
        return row.last_step_age_s
    if row.started_at and row.polled_at and row.polled_at >= row.started_at:
        return row.polled_at - row.started_at
    return None


EXITED_STATES = ("gone", "zombie", "dead")  # a process state whose rank has exited


@dataclass(slots=True)
class Stall:
    stalled: bool
    age_s: float | None  # the job's age: the smallest rank age (None: no rank to judge)
    stall_after_s: float
    first_step: bool  # no rank has stepped yet: the age counts from the processes' start
    last_step: int  # the highest step of any rank
    ranks: int


def check_stall(rows: Sequence[RankProgress], stall_after: float | None = None) -> Stall:
    """Whether no rank of ``rows`` (one job, every node) advanced for the stall time."""
    live = [r for r in rows if r.process_state not in EXITED_STATES]
    limit = stall_after if stall_after is not None else default_stall_after(live)
    ages = [a for a in (rank_age(r) for r in live) if a is not None]
    age = min(ages) if ages else None
    return Stall(
        stalled=age is not None and age >= limit,
        age_s=age,
        stall_after_s=limit,
        first_step=bool(live) and all(r.step == 0 for r in live),
        last_step=max((r.step for r in live), default=0),
        ranks=len(live),
    )


# -- frames ------------------------------------------------------------------------------------------
def _main_frames(p: ProcessStacks | None) -> list[Frame]:
    if p is None:
        return []
    main = p.main_thread()
    return list(main.frames) if main is not None else []


def python_frames(frames: Sequence[Frame]) -> list[Frame]:
    return [f for f in frames if not f.native]


def in_communication_api(f: Frame) -> bool:
    """Whether a Python frame is torch.distributed's communication API (see above)."""
    return not f.native and bool(_COMMUNICATION_API.search(f.file.replace("\\", "/")))


def is_communication_frame(f: Frame) -> bool:
    """Whether a native frame is in communication code (see above): a communication library's
    shared object, or torch's communication namespaces outside its Python bindings."""
    if not f.native:
        return False
    lib = _lib(f)
    if _COMMUNICATION_LIBRARY.match(lib):
        return True
    return not lib.startswith(_BINDINGS_LIBRARY) and bool(_COMMUNICATION_NAMESPACE.match(f.function))


def _stripped_libraries(frames: Sequence[Frame]) -> set[str]:
    """The libraries of a stack that show an address where a symbol would be: stripped, so the
    names their other frames show are only the nearest exports, not the calls being made."""
    return {_lib(f) for f in frames if f.native and not _symbol_named(f)}


def _communication_call(frames: Sequence[Frame]) -> Frame | None:
    """The frame that names the call a stack makes into communication code: the outermost one
    (the call the program's side made; the frames inside it are the library's own machinery)
    whose symbol is the call's own (named, in a library not stripped); else the innermost frame
    of communication code, whose library is all that is known."""
    comm = [f for f in frames if is_communication_frame(f)]
    if not comm:
        return None
    stripped = _stripped_libraries(frames)
    named = [f for f in comm if _symbol_named(f) and _lib(f) not in stripped]
    return named[-1] if named else comm[0]


def collective_of(frames: Sequence[Frame]) -> str | None:
    """The collective a stack waits in, or None: the call the program made into communication
    code, whatever its name. In Python, the outermost frame of torch.distributed's communication
    API ("all_gather_into_tensor", not the "all_gather_single" it calls; the function without its
    class, as every reader names it); else the call into communication code its native frames show
    ("c10d::ProcessGroupGloo::RecvWork::wait", "PMPI_Allreduce", or "a call into libnccl.so.2
    (stripped: the call is not named)")."""
    api = [f for f in frames if in_communication_api(f)]
    if api:
        return api[-1].function.rsplit(".", 1)[-1]
    call = _communication_call(frames)
    if call is None:
        return None
    if _symbol_named(call) and _lib(call) not in _stripped_libraries(frames):
        return native_name(call)
    return f"a call into {_lib(call) or 'a communication library'} (stripped: the call is not named)"


def native_name(f: Frame) -> str:
    name = f.function.split("(")[0]
    return name if len(name) <= 80 else name[:77] + "..."


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame of the program's own code; else the innermost Python frame."""
    py = python_frames(frames)
    for f in py:
        if not is_library_path(f.file) and not f.file.startswith("<"):
            return f
    return py[0] if py else None


def native_frame(frames: Sequence[Frame]) -> Frame | None:
    """The native frame that says where a rank is: the call into communication code where there
    is one (see :func:`collective_of`), else the innermost named frame of a GPU library (a
    spinning wait is caught anywhere in its loop: in the driver, in the vDSO's clock, so the
    library's own frame says whose wait it is), else the innermost named frame of a library of the
    program's (not libc, not Python's own)."""
    call = _communication_call(frames)
    if call is not None:
        return call
    gpu = next((f for f in frames if f.native and _symbol_named(f) and is_gpu_library(f)), None)
    if gpu is not None:
        return gpu
    for f in frames:
        if not f.native or not _symbol_named(f):
            continue
        if not _is_system(f):
            return f
    return next((f for f in frames if f.native and f.function not in ("???", "")), None)


# -- waiting for the GPU ------------------------------------------------------------------------------
# A frame is a call into the GPU's host side when its *library* is one: the symbol a stack shows
# for an address inside a stripped library (libcuda is one) is the nearest exported name, not the
# call being made, so the symbol decides nothing. The GPU's host side is NVIDIA's CUDA stack (the
# driver, the runtime, and its math and collective libraries: the shared objects named libcuda*,
# libcudart, libcublas*, libcudnn*, libcusparse, libcufft, libcurand, libcusolver, libcupti,
# libnccl, libnvrtc, libnvJitLink, and any library shipped in a CUDA toolkit or an ``nvidia``
# wheel's folder), AMD's (HIP, RCCL, HSA, rocBLAS, MIOpen), and torch's CUDA parts
# (libtorch_cuda*, libc10_cuda).
_GPU_LIBRARY_NAME = re.compile(
    r"^lib(cuda|cudart|cublas|cudnn|cusparse|cufft|curand|cusolver|cupti|cufile|cutensor|nccl|nvrtc|nvJitLink"
    r"|nvToolsExt|nvidia-|torch_cuda|c10_cuda|caffe2_nvrtc|amdhip|hiprtc|rccl|hsa-runtime|rocblas|hipblas|MIOpen)"
)
_GPU_LIBRARY_DIRS = ("/site-packages/nvidia/", "/dist-packages/nvidia/", "/cuda/lib", "/cuda-", "/rocm/lib")
# What each library is, in words (the verdict names the library the call is in).
_GPU_LIBRARY_WORDS = (
    ("libcudart", "the CUDA runtime"),
    ("libcuda", "the CUDA driver"),
    ("libtorch_cuda", "torch's CUDA code"),
    ("libc10_cuda", "torch's CUDA code"),
    ("libnccl", "NCCL"),
    ("librccl", "RCCL"),
    ("libcublas", "cuBLAS"),
    ("libcudnn", "cuDNN"),
    ("libamdhip", "the HIP runtime"),
)


def is_gpu_library(f: Frame) -> bool:
    """Whether a native frame is in a library of the GPU's host side (by its file, see above)."""
    path = f.library or f.file or ""
    return bool(_GPU_LIBRARY_NAME.match(os.path.basename(path))) or any(d in path for d in _GPU_LIBRARY_DIRS)


def _library_words(f: Frame) -> str:
    lib = _lib(f)
    return next((words for prefix, words in _GPU_LIBRARY_WORDS if lib.startswith(prefix)), lib or "a GPU library")


# The call family only words the verdict (what the rank waits in); a rank waits for its GPU by the
# evidence above, whatever family its symbols suggest. Checked in order over the GPU libraries'
# named frames, the most specific first: a copy or a synchronize is named by the runtime's and
# torch's frames (their symbols are exported), the library of a math or collective call by its own.
_GPU_CALLS = (
    ("MemcpyDtoH", "a device-to-host copy"),
    ("_local_scalar_dense", "a device-to-host copy"),
    ("MemcpyHtoD", "a host-to-device copy"),
    ("EventSynchronize", "an event synchronize"),
    ("StreamSynchronize", "a stream synchronize"),
    ("StreamWaitEvent", "a stream wait"),
    ("DeviceSynchronize", "a device synchronize"),
    ("CtxSynchronize", "a device synchronize"),
    ("Memcpy", "a copy between host and device"),
    ("copy_kernel_cuda", "a copy between host and device"),
    ("nccl", "an NCCL call"),
    ("cublas", "a cuBLAS call"),
    ("cudnn", "a cuDNN call"),
    ("LaunchKernel", "a kernel launch"),
)
# Why a call of a family blocks, where that is not plain from its name.
_GPU_CALL_WHY = {
    "a kernel launch": "a launch that does not return waits for a full queue",
    "a cuBLAS call": "its launches wait for a full queue, or it waits for the device",
    "a cuDNN call": "its launches wait for a full queue, or it waits for the device",
}
# torch's Python bindings, as the program wrote the call.
_TORCH_BINDINGS = {
    "THPVariable_item": "Tensor.item",
    "THPVariable_cpu": "Tensor.cpu",
    "THPVariable_tolist": "Tensor.tolist",
    "THPVariable_numpy": "Tensor.numpy",
    "THPVariable_to": "Tensor.to",
    "THPVariable_copy_": "Tensor.copy_",
    "THPVariable_cuda": "Tensor.cuda",
    "THPVariable_nonzero": "Tensor.nonzero",
    "THPVariable_bool_scalar": "Tensor.__bool__",
    "THPVariable_float_scalar": "Tensor.__float__",
    "THPVariable_integral_scalar": "Tensor.__int__",
    "THPVariable_index_scalar": "Tensor.__index__",
    "THCPModule_cudaSynchronize": "torch.cuda.synchronize",
    "THCPEvent_synchronize": "Event.synchronize",
    "THCPStream_synchronize": "Stream.synchronize",
}


def _lib(f: Frame) -> str:
    return os.path.basename(f.library or f.file or "")


def _is_system(f: Frame) -> bool:
    """libc, the loader, Python itself, the vDSO: where any call's wait ends (a poll, a futex, the
    clock a spinning wait reads), so they say nothing of whose call it is."""
    lib = _lib(f)
    return not lib or lib.startswith(_SYSTEM_LIBS) or "vdso" in lib


def _symbol_named(f: Frame) -> bool:
    return f.function not in ("", "???") and not f.function.startswith("0x")


@dataclass(frozen=True, slots=True)
class GpuWait:
    """A call into the GPU's host side that a main thread is in, as a stack shows it."""

    call: str  # "a device-to-host copy", "a call into the CUDA driver (cuGetProcAddress: ...)", ...
    op: str | None  # the call as the program wrote it ("Tensor.cpu"), when its binding says
    frame: Frame  # the innermost frame of a GPU library that names a symbol
    library: str = ""  # the innermost GPU library, in words ("the CUDA driver")


def gpu_wait_of(frames: Sequence[Frame]) -> GpuWait | None:
    """The call into a GPU library a main thread is in, from its native frames; None when the
    innermost frame of a library that is not the system's (libc, Python, the vDSO) is not a GPU
    library's, or Python code is innermost. Whether the rank *waits* is the caller's to judge
    from the samples and the GPU's side (:func:`classify`); this names the call, honestly when
    no symbol says what it is."""
    inner = None
    for f in frames:
        if not f.native:
            return None  # Python code innermost: not in a native call
        if _is_system(f):
            continue
        inner = f
        break
    if inner is None or not is_gpu_library(inner):
        return None
    natives = [f for f in frames if f.native]
    in_gpu = [f for f in natives if is_gpu_library(f) and _symbol_named(f)]
    named = in_gpu[0] if in_gpu else inner
    call = None
    for fragment, words in _GPU_CALLS:
        if any(fragment.lower() in f.function.lower() for f in in_gpu):
            call = words
            break
    symbol = native_name(named) if _symbol_named(named) else "no symbol"
    if call is None:  # no symbol names a family: the library and its nearest symbol, said as such
        call = f"a call into {_library_words(inner)} ({symbol}, the nearest symbol: the call itself is not named)"
    elif call == "a kernel launch":
        call = f"a call into {_library_words(named)} ({symbol}: {_GPU_CALL_WHY[call]})"
    elif call in _GPU_CALL_WHY:
        call = f"{call} ({symbol} in {_library_words(named)}: {_GPU_CALL_WHY[call]})"
    op = None
    for f in natives:
        name = f.function.split("(")[0].rsplit("::", 1)[-1]
        if name in _TORCH_BINDINGS:
            op = _TORCH_BINDINGS[name]
            break
    if op is None:  # torch's own Python wrapper innermost (torch.cuda.synchronize, Event.synchronize)
        lib_py = next((f for f in frames if not f.native), None)
        if lib_py is not None and is_library_path(lib_py.file) and "torch" in lib_py.file:
            op = f"torch.cuda.{lib_py.function}" if lib_py.file.endswith("cuda/__init__.py") else lib_py.function
    return GpuWait(call=call, op=op, frame=named, library=_library_words(inner))


def where(f: Frame | None) -> str:
    """``load_next_batch (data.py:88)``, or a native frame ``cudaStreamSynchronize [libcudart.so]``."""
    if f is None:
        return "?"
    if f.native:
        return f"{native_name(f)} [{os.path.basename(f.library or f.file or '?')}]"
    return f"{f.function} ({short_path(f.file)}:{f.line})"


def _py_key(frames: Sequence[Frame]) -> tuple[tuple[str, str, int], ...]:
    """The Python stack's identity: (function, file, line) per frame, the function without its
    class (py-spy names a method ``Event.synchronize``, the agent's own sample ``synchronize``:
    the same frame read two ways is not a stack that changed)."""
    return tuple((f.function.rsplit(".", 1)[-1], f.file, f.line) for f in python_frames(frames))


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
    frames2 = _main_frames(look.second)
    frames1 = _main_frames(look.first)
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
        stack_key=_py_key(frames),
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
    changed = bool(frames1 and frames2) and _py_key(frames1) != _py_key(frames2)
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


# -- the job -------------------------------------------------------------------------------------------
@dataclass
class Decision:
    kind: str  # "hang", "busy", or "pending" (a hang whose culprits only move, not yet confirmed)
    conclusion: str
    culprits: list[Culprit] = field(default_factory=list)
    states: list[RankState] = field(default_factory=list)
    flight_recorder: str | None = None  # what the flight recorder said, when it was read
    waiting_key: tuple[Any, ...] | None = None  # what the waiting ranks wait in (for confirm_s)


def ranks_text(states: Sequence[RankState], of_total: int | None = None) -> str:
    """``rank 3 on node-1``, ``ranks 0-3 on node-1, ranks 4-7 on node-2``."""
    by_node: dict[str, list[int | None]] = {}
    for s in states:
        by_node.setdefault(s.node, []).append(s.rank)
    parts = []
    for node, ranks in by_node.items():
        known = sorted(r for r in ranks if r is not None)
        pids = [s.pid for s in states if s.node == node and s.rank is None]
        label = _span(known)
        text = (f"rank {label}" if len(known) == 1 else f"ranks {label}") if known else ""
        if pids:
            text = (text + ", " if text else "") + "pid " + ",".join(str(p) for p in pids[:8])
        parts.append(f"{text} on {node}")
    if len(parts) > 4:
        return f"{len(states)} ranks on {len(parts)} nodes"
    return ", ".join(parts)


def _span(ranks: list[int]) -> str:
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _culprit(s: RankState, why: str) -> Culprit:
    return Culprit(rank=s.rank, host=s.node, pid=s.pid, where=s.where, why=why, since_step=s.step)


def _phrase(s: RankState, others: str | None) -> str:
    """What a culprit is doing, after "rank 37 on node-5 ": "is in load_next_batch (...) ..."."""
    if s.state == "stopped":
        return f"is stopped (SIGSTOP or a debugger) in {s.where}"
    if s.state == "in-c":
        return f"is stuck in C holding the GIL in {s.where}"
    if s.state == "moving":
        tail = f", not in the {others} the others wait in" if others else ""
        return f"is in {s.where}, {s.detail}{tail}"
    if s.state == "parked":
        return f"is in {s.where}, parked" + (" (no CPU)" if s.cpu_delta_s is not None else "")
    if s.state == "waiting":
        return f"waits in {s.collective} at {s.where}"
    if s.state == "waiting-gpu":
        tail = f", not in the {others} the others wait in" if others else ""
        return f"waits for its GPU in {s.gpu_call}{tail}"
    if s.state == "in-gpu-library":
        tail = f", not in the {others} the others wait in" if others else ""
        return (
            f"is held in {s.gpu_call}{tail}, but its GPU has nothing to wait for ({s.gpu_evidence}): "
            "the call waits on the host, not on the device"
        )
    if s.state == "gone":
        return "is gone (its process exited)"
    return f"cannot be read ({s.detail})"


def _groups(states: Sequence[RankState], key: Any) -> list[list[RankState]]:
    buckets: dict[Any, list[RankState]] = {}
    for s in states:
        buckets.setdefault(key(s), []).append(s)
    return sorted(buckets.values(), key=lambda g: (-len(g), min((s.rank or 0) for s in g)))


def _since(states: Sequence[RankState]) -> str:
    steps = sorted({s.step for s in states if s.step is not None})
    unknown = sum(1 for s in states if s.step is None)
    if not steps:
        its = "its" if len(states) == 1 else "their"
        return f" ({its} last step unknown: {its} agent has not answered this watch)"
    text = f" since step {steps[0]}" if len(steps) == 1 else f" since steps {steps[0]}-{steps[-1]}"
    return text + (f" ({unknown} with the last step unknown)" if unknown else "")


def _culprit_text(culprits: Sequence[RankState], others: str | None) -> str:
    parts = []
    for group in _groups(culprits, lambda s: (s.state, s.where)):
        verb = _phrase(group[0], others)
        if len(group) > 1:
            verb = verb.replace("is ", "are ", 1).replace("waits ", "wait ", 1).replace(" its GPU ", " their GPUs ", 1)
        parts.append(f"{ranks_text(group)} {verb}{_since(group)}")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class FlightRecorderReading:
    """What the flight recorder says of the collective a job hangs in: the ranks it holds
    responsible (rank -> why, in words) and its line for the verdict."""

    culprits: dict[int, str] = field(default_factory=dict)
    text: str | None = None


def _ranks_in(value: Any) -> list[int]:
    return [r for r in value or [] if isinstance(r, int) and not isinstance(r, bool)] if isinstance(value, list) else []


def flight_recorder_reading(analysis: dict[str, Any] | None, waiting: Sequence[int] = ()) -> FlightRecorderReading:
    """The ranks that hold a collective, from the flight recorder's analysis
    (:func:`collectors.flight_recorder.analyze`). A collective completes only once every rank of
    its process group has enqueued it, and the recorder numbers each group's collectives in the
    order every rank enqueues them; so, in a group where some ranks wait in collective #N:

    - a rank whose last enqueued number is below N never enqueued it (``missing``): it holds them;
    - a rank whose entry #N is another collective or other sizes (``mismatched``) enqueued a
      different one: the ranks disagree on what #N is, and it is the odd one;
    - a member with no dump said nothing (``no_dump``): named only when nothing else is, as the
      rank the recorder could not read, never as one that did not enqueue.

    Of several groups that hang, the one read is the one whose waiting ranks are most of
    ``waiting`` (the ranks the stacks show waiting): the hang the watch sees; the first listed
    when nothing tells them apart. Bounded: sizes and texts from the analysis are cut."""
    if not isinstance(analysis, dict):
        return FlightRecorderReading()
    listed = analysis.get("process_groups")
    listed = listed[:1024] if isinstance(listed, list) else []
    groups = [pg for pg in listed if isinstance(pg, dict) and pg.get("hung")]
    if not groups:
        return FlightRecorderReading()
    seen = set(waiting)
    pg = max(groups, key=lambda g: len(seen.intersection(_ranks_in(g.get("waiting")))))  # max keeps the first of ties
    collective = str(pg.get("collective") or "?")[:200]
    missing = sorted(set(_ranks_in(pg.get("missing"))))
    mismatched: dict[int, str] = {}
    for m in (pg.get("mismatched") or [])[:1024] if isinstance(pg.get("mismatched"), list) else []:
        if isinstance(m, dict) and isinstance(m.get("rank"), int) and not isinstance(m.get("rank"), bool):
            mismatched[m["rank"]] = str(m.get("collective") or "?")[:200]
    no_dump = sorted(set(_ranks_in(pg.get("no_dump"))) - set(missing) - set(mismatched))
    culprits: dict[int, str] = {}
    parts: list[str] = []
    if missing:
        who = ",".join(str(r) for r in missing)
        parts.append(f"missing rank{'s' if len(missing) > 1 else ''} {who} in {collective}")
        culprits.update((r, "never enqueued the collective the others wait in (flight recorder)") for r in missing)
    for r, theirs in sorted(mismatched.items()):
        parts.append(f"rank {r} enqueued {theirs} where the others wait in {collective}")
        culprits[r] = f"enqueued {theirs} where the others enqueued {collective} (flight recorder)"
    if no_dump and not culprits:
        who = ",".join(str(r) for r in no_dump)
        parts.append(f"no dump from rank{'s' if len(no_dump) > 1 else ''} {who} while the others wait in {collective}")
        culprits.update(
            (r, "gave the flight recorder no dump while the others wait (flight recorder)") for r in no_dump
        )
    if not parts:
        return FlightRecorderReading(text=f"flight recorder: {str(pg.get('verdict') or '')[:300]}")
    return FlightRecorderReading(culprits, "flight recorder: " + "; ".join(parts))


def decide(
    looks: Sequence[RankLook],
    stall: Stall,
    flight_recorder: dict[str, Any] | None = None,
    waiting_for_s: float | None = None,
    confirm_s: float = 0.0,
    moving_cpu_s: float = MOVING_CPU_S,
) -> Decision:
    """What a stalled job is doing, from the look at every rank. ``waiting_for_s``: how long
    the waiting ranks have been seen waiting in the same place (the engine's count, across
    looks); a hang whose only culprits move is called once that reaches ``confirm_s``."""
    states = [classify(look, moving_cpu_s) for look in looks]
    states.sort(key=lambda s: (s.rank if s.rank is not None else 1 << 30, s.node, s.pid))
    age = f"{stall.age_s:.0f} s" if stall.age_s is not None else "a while"
    head = f"no first step {age} after start" if stall.first_step else f"no step for {age}"
    waiting = [s for s in states if s.state == "waiting"]
    others = [s for s in states if s.state != "waiting"]
    fr = flight_recorder_reading(flight_recorder, [s.rank for s in waiting if s.rank is not None])
    fr_missing, fr_text = sorted(fr.culprits), fr.text
    fr_clause = f" ({fr_text})" if fr_text else ""
    if not states:
        return Decision("busy", f"{head}: no rank could be read", states=states)
    if waiting and others:
        # Ranks wait for their peers while others do not come: those others hold them, wherever
        # they are (a rank held by its GPU, a parked or stopped one, one that works elsewhere).
        main = _groups(waiting, lambda s: s.collective)[0]
        collective = main[0].collective
        main_where = _groups(main, lambda s: s.where)[0][0].where
        # A culprit that works (spends CPU, does I/O, its stack changes) may yet reach the
        # collective: a hang held only by such ranks is called once confirmed. Any other culprit
        # does not move: nothing it does brings it to the others.
        stuck = [s for s in others if s.state != "moving"]
        text = (
            _culprit_text(others, collective)
            + f"; {_the_others(len(waiting))} in {collective} "
            + f"at {main_where}{fr_clause}"
        )
        culprits = [_culprit(s, s.detail or s.state) for s in others]
        if not stuck and (waiting_for_s is None or waiting_for_s < confirm_s):
            return Decision(
                "pending",
                f"{head}: {text}; not called a hang yet (the waiting ranks wait for "
                f"{waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
                culprits[:MAX_CULPRITS],
                states,
                fr_text,
                waiting_key=_waiting_key(waiting),
            )
        return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
    if waiting and not others:
        groups = _groups(waiting, lambda s: (s.collective, s.stack_key))
        main = groups[0]
        if fr_missing:
            by_rank = {s.rank: s for s in states}
            named = [by_rank[r] for r in fr_missing if r in by_rank]
            rest = [s for s in states if s.rank not in set(fr_missing)]
            text = (
                f"{_culprit_text(named, None) if named else 'ranks ' + ','.join(map(str, fr_missing))}"
                f"; {_the_others(len(rest))} in {main[0].collective} at {main[0].where}{fr_clause}"
            )
            culprits = [_culprit(s, fr.culprits[s.rank]) for s in named if s.rank is not None] or [
                Culprit(rank=r, host="?", where="?", why=fr.culprits[r]) for r in fr_missing
            ]
            return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
        if len(groups) > 1:
            behind = _behind(groups, tied=len(groups[1]) == len(main))
            if behind is not None:
                held, why = behind
                rest = [s for s in waiting if s not in held]
                text = f"{_culprit_text(held, None)}: {why}; {_the_others(len(rest))} {_positions(rest)}{fr_clause}"
                culprits = [_culprit(s, f"waits in {s.collective} at {s.where}: {why}") for s in held]
                return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
            if len(groups[1]) == len(main):
                # As many ranks in one wait as in another, and nothing says which is behind:
                # the positions are said, no rank is named (its number is no evidence).
                text = (
                    f"the ranks wait in {len(groups)} different places and the watch cannot tell which holds "
                    f"the others (the same steps, no rank left the loop alone): {_culprit_text(waiting, None)}"
                    f"{fr_clause}"
                    + (
                        ""
                        if fr_text
                        else "; with the flight recorder on (`dynprof run --flight-recorder`) the watch would "
                        "name the rank that is missing"
                    )
                )
                return Decision("hang", text, [], states, fr_text, _waiting_key(waiting))
            # A majority in one wait is where the program's ranks are: the ranks elsewhere diverged
            # (another collective, another call site) and hold them.
            odd = [s for g in groups[1:] for s in g]
            text = (
                f"{_culprit_text(odd, None)}; {_the_others(len(main))} "
                f"in {main[0].collective} at {main[0].where}{fr_clause}"
            )
            culprits = [_culprit(s, f"waits in {s.collective} at {s.where}, not where the others wait") for s in odd]
            return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(waiting))
        text = f"all {len(states)} ranks wait in {main[0].collective} at {main[0].where} and none moves{fr_clause}" + (
            ""
            if fr_text
            else "; with the flight recorder on (`dynprof run --flight-recorder`) "
            "the watch would name the rank that is missing"
        )
        return Decision("hang", text, [], states, fr_text, _waiting_key(waiting))
    # No rank waits in a collective.
    on_gpu = [s for s in states if s.state == "waiting-gpu"]
    if on_gpu and len(on_gpu) == len(states):
        text = (
            f"{head}: every rank waits for its GPU: {_culprit_text(on_gpu, None)}; the hang is on the devices "
            "(a GPU kernel that does not end, or a collective inside NCCL)"
            + (
                fr_clause
                if fr_text
                else "; with the flight recorder on (`dynprof run --flight-recorder`) the watch would say "
                "which NCCL collective each rank is in"
            )
        )
        culprits = [_culprit(s, s.detail) for s in on_gpu]
        if waiting_for_s is None or waiting_for_s < confirm_s:
            return Decision(
                "pending",
                f"{text}; not called a hang yet (seen for {waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
                culprits[:MAX_CULPRITS],
                states,
                fr_text,
                waiting_key=_waiting_key(on_gpu),
            )
        return Decision("hang", text, culprits[:MAX_CULPRITS], states, fr_text, _waiting_key(on_gpu))
    stuck = [s for s in states if s.state in ("stopped", "in-c")]
    if stuck:
        rest = [s for s in states if s.state not in ("stopped", "in-c")]
        text = _culprit_text(stuck, None)
        if rest:
            text += "; " + _busy_text(rest)
        return Decision("hang", text, [_culprit(s, s.detail) for s in stuck][:MAX_CULPRITS], states, fr_text)
    moving = [s for s in states if s.state == "moving"]
    if moving:
        return Decision("busy", f"{head}: {_busy_text(states)}", [], states, fr_text)
    text = f"{head}, and no rank moves: {_culprit_text(states, None)}{fr_clause}"
    culprits = [_culprit(s, s.detail or s.state) for s in states][:MAX_CULPRITS]
    if waiting_for_s is None or waiting_for_s < confirm_s:
        # One look of a few seconds in which no rank spent CPU is also what a CPU-starved node
        # shows (a busy phase's DataLoader workers behind another job's processes): the same
        # ranks, still where they were, once ``confirm_s`` has passed, are a hang.
        return Decision(
            "pending",
            f"{text}; not called a hang yet (seen for {waiting_for_s or 0:.0f} s of the {confirm_s:.0f} s asked)",
            culprits,
            states,
            fr_text,
            waiting_key=_waiting_key(states),
        )
    return Decision("hang", text, culprits, states, fr_text, _waiting_key(states))


def meets_only(collective: str | None) -> bool:
    """Whether a collective only meets the other ranks and carries no data: a barrier, whoever
    provides it (torch.distributed's ``barrier`` and ``monitored_barrier``, the store's
    ``_store_based_barrier``, ``MPI_Barrier``, a backend's own ``c10d::...::barrier``). A rank
    waits in one once the work before it is done, which a collective that carries data (the
    gradients' all_reduce) does not say."""
    return collective is not None and "barrier" in collective.lower()


def _behind(groups: Sequence[Sequence[RankState]], tied: bool) -> tuple[list[RankState], str] | None:
    """The ranks that hold the others when every rank waits, but in different places, from the
    evidence of their positions (never their numbers):

    - the ranks in a barrier (:func:`meets_only`) while every other rank waits in a collective that
      carries data: they finished the work the others are still in (the loop), and the others'
      collective waits for them to come back to it;
    - else, where as many ranks wait in one place as in another (``tied``: no majority says where
      the program's ranks are), the ranks with the fewest steps, every rank's count known: the
      others made more, so they are behind.

    None when nothing tells them apart."""
    everyone = [s for g in groups for s in g]
    at_end = [s for s in everyone if meets_only(s.collective)]
    inside = [s for s in everyone if not meets_only(s.collective)]
    if at_end and inside:
        who = "it" if len(at_end) == 1 else "they"
        return at_end, f"{who} left the loop the others are in (a {at_end[0].collective} after it)"
    counted = [s.step for s in everyone if s.step is not None]
    steps = sorted(set(counted))
    if tied and len(steps) > 1 and len(counted) == len(everyone):  # every rank's count known
        low = [s for s in everyone if s.step == steps[0]]
        ahead = sorted({s.step for s in everyone if s.step is not None and s.step != steps[0]})
        more = f"{ahead[0]}" if len(ahead) == 1 else f"{ahead[0]}-{ahead[-1]}"
        who = "it is" if len(low) == 1 else "they are"
        return low, f"{who} behind: {steps[0]} steps where the others made {more}"
    return None


def _positions(states: Sequence[RankState]) -> str:
    """``in all_reduce at train_step (train.py:40)``, each distinct wait once."""
    seen: list[str] = []
    for s in states:
        place = f"in {s.collective} at {s.where}"
        if place not in seen:
            seen.append(place)
    return " and ".join(seen[:4]) + (f" and {len(seen) - 4} more places" if len(seen) > 4 else "")


def _the_others(n: int) -> str:
    """``the other rank waits``, ``the other 3 ranks wait``."""
    return "the other rank waits" if n == 1 else f"the other {n} ranks wait"


def _waiting_key(waiting: Sequence[RankState]) -> tuple[Any, ...]:
    return tuple(sorted((s.node, s.pid, s.collective or "", s.where) for s in waiting))


def _common_user_frame(states: Sequence[RankState]) -> str | None:
    """The innermost frame of the program's own code that every rank's stack passes through
    (``evaluate`` when the ranks are in different lines below it), or None."""
    chains = []
    for s in states:
        frames = [f for f in reversed(s.frames) if not f.native and not is_library_path(f.file)]
        if not frames:
            return None
        chains.append(frames)
    common: Frame | None = None
    for level in zip(*chains):
        if len({(f.function, f.file) for f in level}) != 1:
            break
        common = level[0]
    return where(common) if common is not None else None


def _moving_evidence(group: Sequence[RankState]) -> str:
    """What a group of moving ranks was measured doing across the look, each fact once, with how
    many of the group showed it where not all did: ``CPU +1.2-1.5 s in 3.0 s``, ``I/O +8.0 MB``,
    ``in disk I/O (process state D)``, ``stack changed``."""
    n = len(group)

    def of(ranks: Sequence[RankState], fact: str) -> str:
        return fact if len(ranks) == n else f"{len(ranks)} of {n}: {fact}"

    def spread(values: Sequence[float], unit: str, fmt: str = ".1f") -> str:
        lo, hi = min(values), max(values)
        return f"+{lo:{fmt}}{unit}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"+{lo:{fmt}}-{hi:{fmt}}{unit}"

    parts = []
    cpu = [s for s in group if "cpu" in s.moved_by and s.cpu_delta_s is not None]
    if cpu:
        span = max(s.span_s for s in cpu)
        parts.append(of(cpu, f"CPU {spread([s.cpu_delta_s or 0.0 for s in cpu], ' s')} in {span:.1f} s"))
    io = [s for s in group if "io" in s.moved_by and s.io_delta_b is not None]
    if io:
        parts.append(of(io, f"I/O {spread([(s.io_delta_b or 0) / 1e6 for s in io], ' MB')}"))
    disk = [s for s in group if "disk" in s.moved_by]
    if disk:
        parts.append(of(disk, "in disk I/O (process state D)"))
    changed = [s for s in group if "stack" in s.moved_by]
    if changed:
        parts.append(of(changed, "stack changed"))
    return ", ".join(parts)


def _busy_text(states: Sequence[RankState]) -> str:
    """Where the ranks of a job that works at something other than steps are, and what was
    measured of each (busy: no rank waits for a peer and some rank moves)."""
    if len(states) > 1 and all(s.state == "moving" for s in states):
        shared = _common_user_frame(states)
        outer = {s.where for s in states}
        if shared is not None and len(outer) > 1 and not shared.startswith("<module>"):
            return f"all ranks in {shared}, moving ({_moving_evidence(states)})"
    parts = []
    groups = _groups(states, lambda s: (s.state, s.where))
    for group in groups:
        who = "all ranks" if len(group) == len(states) and len(states) > 1 else ranks_text(group)
        state = group[0].state
        what = f"moving ({_moving_evidence(group)})" if state == "moving" else group[0].describe()
        parts.append(f"{who} in {group[0].where}, {what}")
    return "; ".join(parts)
