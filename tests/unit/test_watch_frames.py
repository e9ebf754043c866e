"""Where a rank's main thread is, from its frames (dynprof.watch.frames): a GPU library is known by its
file, never by the symbol."""

from __future__ import annotations

from dynprof.watch import frames as frame_rules
from tests.unit.test_watch_detect import LIBC, LIBCUDA, LIBCUDART, LIBTORCH_CUDA, TRAIN, native


def test_the_library_decides_not_the_symbol():
    # GIVEN the same symbol in a GPU library and in a library of the program's
    in_driver = (native("cuLaunchKernel", LIBCUDA), *TRAIN)
    in_program = (native("cuLaunchKernel", "/job/libmyshim.so"), *TRAIN)
    # THEN only the first is a call into a GPU library
    assert frame_rules.gpu_wait_of(in_driver) is not None
    assert frame_rules.gpu_wait_of(in_program) is None
    # AND the libraries of the GPU's host side are known by their files, named or in a CUDA folder
    for lib in (
        LIBCUDA,
        LIBCUDART,
        LIBTORCH_CUDA,
        "/usr/lib/libc10_cuda.so",
        "/usr/lib/libnccl.so.2",
        "libcublas.so.13",
        "libcublasLt.so.13",
        "libcudnn_ops.so.9",
        "/usr/local/cuda-12.4/lib64/libsomething.so",
    ):
        assert frame_rules.is_gpu_library(native("x", lib)), lib
    for lib in (LIBC, "/usr/lib/libcurl.so.4", "/torch/lib/libtorch_cpu.so", "/torch/lib/libgloo.so"):
        assert not frame_rules.is_gpu_library(native("x", lib)), lib
