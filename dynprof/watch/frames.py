"""Where a rank's main thread is, from its frames: in a collective (communication code, by where
the code lives), in a GPU library (by the native frame's library, never its symbol), in the
user's code or in C.

Pure functions of one process's frames (:class:`collectors.stacks.Frame`), for the rank's
state (:mod:`dynprof.watch.classify`) and the look (:mod:`dynprof.watch.look`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from collectors.stacks import Frame, ProcessStacks, is_library_path, short_path

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


# -- frames ------------------------------------------------------------------------------------------
def main_frames(p: ProcessStacks | None) -> list[Frame]:
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


def py_key(frames: Sequence[Frame]) -> tuple[tuple[str, str, int], ...]:
    """The Python stack's identity: (function, file, line) per frame, the function without its
    class (py-spy names a method ``Event.synchronize``, the agent's own sample ``synchronize``:
    the same frame read two ways is not a stack that changed)."""
    return tuple((f.function.rsplit(".", 1)[-1], f.file, f.line) for f in python_frames(frames))
