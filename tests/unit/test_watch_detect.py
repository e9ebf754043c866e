"""The watch's decisions (dynprof.watch.detect) on crafted progress rows and stack samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.stacks import Frame, ProcessStacks, ThreadStack
from collectors.stacks.readers import parse_py_spy
from dynprof.watch import classify, detect
from dynprof.watch import frames as frame_rules
from dynprof.watch import stall as stall_rule
from dynprof.watch.model import RankProgress

DIST = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
NOW = 1_000_000.0


def row(rank: int, step: int = 100, age: float | None = 80.0, cpu: float = 10.0, t: float = NOW, **kw) -> RankProgress:
    r = RankProgress(
        job="j",
        rank=rank,
        world_size=4,
        pid=1000 + rank,
        host="h",
        step=step,
        last_step_at=(t - age) if age is not None else 0.0,
        last_step_age_s=age,
        step_time_s=0.5,
        cpu_s=cpu,
        started_at=t - 3600,
        polled_at=t,
        process_state="sleeping",
    )
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def stacks(rank: int, *frames: Frame, holds_gil: bool | None = None) -> ProcessStacks:
    return ProcessStacks(
        pid=1000 + rank,
        method="py-spy",
        rank=rank,
        host="h",
        threads=[ThreadStack(tid=1000 + rank, main=True, holds_gil=holds_gil, frames=list(frames))],
    )


def py(function: str, file: str = "/job/train.py", line: int = 10) -> Frame:
    return Frame(function, file, line)


ALL_REDUCE = (py("all_reduce", DIST, 2806), py("train_step", "/job/train.py", 40), py("main", "/job/train.py", 99))


def look(
    rank: int,
    node: str,
    first: tuple[Frame, ...],
    second: tuple[Frame, ...] | None = None,
    cpu_delta: float = 0.0,
    **kw,
) -> classify.RankLook:
    before = row(rank, **kw)
    after = row(rank, cpu=before.cpu_s + cpu_delta, t=NOW + 3.0, **{**kw, "age": (kw.get("age", 80.0) or 0) + 3.0})
    if kw.get("age", 80.0) is None:
        after.last_step_age_s = None
    return classify.RankLook(
        node=node,
        before=before,
        after=after,
        first=stacks(rank, *first),
        second=stacks(rank, *(second if second is not None else first)),
    )


STALL = stall_rule.Stall(stalled=True, age_s=80.0, stall_after_s=60.0, first_step=False, last_step=100, ranks=4)


def test_a_rank_parked_in_data_loading_is_the_culprit_of_the_others_wait():
    # GIVEN ranks 0-2 waiting in all_reduce, rank 3 on node-2 parked in load_next_batch
    looks = [look(r, "node-1" if r < 2 else "node-2", ALL_REDUCE) for r in range(3)]
    looks.append(look(3, "node-2", (py("load_next_batch", "/job/data.py", 88), py("main", "/job/train.py", 90))))
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN a hang naming rank 3 on node-2 where it is
    assert decision.kind == "hang"
    assert [(c.rank, c.host, c.where) for c in decision.culprits] == [
        (3, "node-2", "load_next_batch (/job/data.py:88)")
    ]
    assert decision.conclusion.startswith("rank 3 on node-2 is in load_next_batch (/job/data.py:88), parked")
    assert "since step 100" in decision.conclusion
    assert "the other 3 ranks wait in all_reduce" in decision.conclusion
    assert [s.state for s in decision.states] == ["waiting", "waiting", "waiting", "parked"]


def test_a_stopped_rank_is_named_stopped():
    # GIVEN rank 1 stopped (state T), its agent silent, the others in all_reduce
    looks = [look(r, "n", ALL_REDUCE) for r in (0, 2)]
    looks.append(look(1, "n", (py("load_next_batch"),), process_state="stopped", agent="unresponsive"))
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert "rank 1 on n is stopped" in decision.conclusion


def test_a_rank_in_c_holding_the_gil_is_named_with_its_native_frame():
    # GIVEN rank 1 whose agent does not answer, holding the GIL in a C call, no CPU
    native = Frame("spin_kernel", "", 0, native=True, library="/job/libmyext.so")
    frames = (native, py("sync_all", "/job/train.py", 55))
    looks = [look(0, "n", ALL_REDUCE), look(1, "n", frames, agent="unresponsive")]
    looks[1].second = stacks(1, *frames, holds_gil=True)
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN
    assert decision.kind == "hang"
    (culprit,) = decision.culprits
    assert culprit.rank == 1 and culprit.where == "sync_all (/job/train.py:55) [native: spin_kernel [libmyext.so]]"
    assert "stuck in C holding the GIL" in decision.conclusion


def test_a_rank_blocked_in_a_cuda_synchronize_is_named_with_its_native_frame():
    # GIVEN rank 1 in cudaStreamSynchronize (a spinning wait: CPU advances), the others in all_reduce
    native = Frame("cudaStreamSynchronize", "", 0, native=True, library="/usr/lib/libcudart.so.12")
    frames = (native, py("synchronize", "/venv/lib/python3.11/site-packages/torch/cuda/__init__.py", 9), py("step"))
    looks = [look(0, "n", ALL_REDUCE), look(2, "n", ALL_REDUCE), look(1, "n", frames, cpu_delta=2.9)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN it is the odd wait, named with its native frame
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert decision.culprits[0].where == "step (/job/train.py:10) [native: cudaStreamSynchronize [libcudart.so.12]]"


def test_a_rank_that_holds_the_gil_but_works_is_moving_not_stuck():
    # GIVEN every rank importing torch (the agents do not answer, native frames), CPU advancing
    native = Frame("PyImport_ImportModule", "", 0, native=True, library="/usr/lib/libpython3.11.so")
    frames = (native, py("<module>", "/job/train.py", 3))
    looks = [look(r, "n", frames, cpu_delta=2.0, step=0, age=None, agent="unresponsive") for r in range(2)]
    stall = stall_rule.Stall(True, 30.0, 20.0, first_step=True, last_step=0, ranks=2)
    # WHEN
    decision = detect.decide(looks, stall)
    # THEN busy, never a hang
    assert decision.kind == "busy"
    assert decision.conclusion.startswith(
        "no first step 30 s after start: all ranks in <module> (/job/train.py:3), moving"
    )


def test_all_ranks_saving_a_checkpoint_are_busy():
    # GIVEN every rank in save_checkpoint, spending CPU
    frames = (py("write", "/job/ckpt.py", 12), py("save_checkpoint", "/job/train.py", 210))
    looks = [look(r, "n", frames, cpu_delta=1.5) for r in range(4)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN reported as what it is, with what was measured of it
    assert decision.kind == "busy" and decision.culprits == []
    assert decision.conclusion == "no step for 80 s: all ranks in write (/job/ckpt.py:12), moving (CPU +1.5 s in 3.0 s)"


def checkpoint_writers(writers_cpu_delta: float):
    """Four ranks in save_checkpoint: 0 and 1 in disk I/O (state D) with no CPU between the
    samples, 2 and 3 having written 8 MB meanwhile with ``writers_cpu_delta`` s of CPU."""
    frames = (py("save_checkpoint", "/job/train.py", 210),)
    looks = [look(r, "n", frames, cpu_delta=0.0 if r < 2 else writers_cpu_delta) for r in range(4)]
    for lk in looks[:2]:
        lk.before.process_state = "disk-sleep"
    for lk in looks[2:]:
        assert lk.after is not None
        lk.before.io_bytes, lk.after.io_bytes = 10_000_000, 18_000_000
    return looks


def test_ranks_blocked_writing_a_checkpoint_are_busy_not_parked():
    # GIVEN every rank in save_checkpoint with no CPU between the samples (a slow disk's fsync),
    # two of them seen in disk I/O (state D), the other two having written 8 MB meanwhile
    looks = checkpoint_writers(writers_cpu_delta=0.0)
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN busy: they work (at the disk), and each says how it was seen to
    assert decision.kind == "busy" and decision.culprits == []
    assert "moving" in decision.conclusion
    details = [s.detail for s in decision.states]
    assert all("in disk I/O (process state D)" in d for d in details[:2]), details
    assert all("I/O +8.0 MB" in d for d in details[2:]), details


def test_one_poll_seen_twice_does_not_claim_no_cpu():
    # GIVEN a look whose two progress rows are the same poll of the node (a sidecar that
    # answers from its book and did not poll in between)
    frames = (py("_poll", "/usr/lib/python3.11/multiprocessing/connection.py", 440), py("main", "/job/train.py", 60))
    lk = look(0, "n", frames)
    lk.after = lk.before
    # WHEN
    state = classify.classify(lk)
    # THEN its CPU is unknown, and nothing says it spent none
    assert state.cpu_delta_s is None
    assert state.state == "parked" and "not measured" in state.detail
    assert "no CPU" not in detect.decide([lk], STALL).conclusion


def test_a_rank_caught_twice_in_a_short_collective_while_computing_is_not_waiting():
    # GIVEN an evaluation loop: rank 0 caught in its metric's all_reduce in both samples but
    # spending CPU between them; rank 1 in the forward pass
    looks = [look(0, "n", ALL_REDUCE, cpu_delta=2.0), look(1, "n", (py("forward", "/job/model.py", 5),), cpu_delta=2.0)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN busy: the all_reduce is not a wait
    assert decision.kind == "busy"
    assert [s.state for s in decision.states] == ["moving", "moving"]


def test_a_rank_that_only_moves_is_a_hang_once_the_others_waited_long_enough():
    # GIVEN rank 1 spinning in Python while the others wait in all_reduce
    spin = (py("spin", "/job/train.py", 70),)
    looks = [look(0, "n", ALL_REDUCE), look(2, "n", ALL_REDUCE), look(1, "n", spin, cpu_delta=2.9)]
    # WHEN the others have waited 5 s of the 30 asked, then 31 s
    early = detect.decide(looks, STALL, waiting_for_s=5.0, confirm_s=30.0)
    late = detect.decide(looks, STALL, waiting_for_s=31.0, confirm_s=30.0)
    # THEN first pending, then a hang naming the spinner
    assert early.kind == "pending" and early.waiting_key == late.waiting_key
    assert late.kind == "hang" and [c.rank for c in late.culprits] == [1]
    assert "moving (CPU +2.9 s in 3.0 s), not in the all_reduce the others wait in" in late.conclusion


def test_a_rank_waiting_in_another_collective_is_the_odd_one():
    # GIVEN every rank waiting, rank 1 in an all_reduce called from report_metrics
    other = (py("all_reduce", DIST, 2806), py("report_metrics", "/job/train.py", 129), py("main", "/job/train.py", 99))
    looks = [look(r, "n", ALL_REDUCE) for r in (0, 2, 3)] + [look(1, "n", other)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert decision.conclusion.startswith("rank 1 on n waits in all_reduce at report_metrics (/job/train.py:129)")


def test_all_in_the_same_collective_uses_the_flight_recorder_to_name_the_missing():
    # GIVEN every rank in the same all_reduce, and the flight recorder saying rank 2 never enqueued #8812
    looks = [look(r, "n", ALL_REDUCE) for r in range(4)]
    fr = {
        "process_groups": [
            {"hung": True, "missing": [2], "no_dump": [], "collective": "#8812 all_reduce", "verdict": "..."}
        ]
    }
    # WHEN with and without it
    without = detect.decide(looks, STALL)
    named = detect.decide(looks, STALL, flight_recorder=fr)
    # THEN without: a hang that cannot name the culprit; with: rank 2
    assert without.kind == "hang" and without.culprits == [] and "--flight-recorder" in without.conclusion
    assert named.kind == "hang" and [c.rank for c in named.culprits] == [2]
    assert "flight recorder: missing rank 2 in #8812 all_reduce" in named.conclusion


def test_a_dataloader_warm_up_is_moving_through_its_workers_cpu():
    # GIVEN ranks whose main thread waits for the first batch while their workers compute
    frames = (py("_poll", "/usr/lib/python3.11/multiprocessing/connection.py", 440), py("main", "/job/train.py", 60))
    looks = [look(r, "n", frames, cpu_delta=2.5, step=0, age=None) for r in range(2)]
    stall = stall_rule.Stall(True, 30.0, 20.0, first_step=True, last_step=0, ranks=2)
    # WHEN
    decision = detect.decide(looks, stall)
    # THEN busy
    assert decision.kind == "busy" and "moving" in decision.conclusion


def test_ranks_text_names_nodes_and_spans():
    # GIVEN states on two nodes
    states = [
        classify.RankState(node="node-1", rank=r, pid=r, step=1, age_s=1.0, state="parked", where="x")
        for r in (0, 1, 2, 5)
    ] + [classify.RankState(node="node-2", rank=8, pid=8, step=1, age_s=1.0, state="parked", where="x")]
    # WHEN / THEN
    assert detect.ranks_text(states) == "ranks 0-2,5 on node-1, rank 8 on node-2"


def test_busy_ranks_in_different_lines_of_one_function_are_said_in_it():
    # GIVEN an evaluation: every rank in evaluate, below it in different helpers
    ranks = [
        look(
            0,
            "n",
            (py("burn", "/job/x.py", 48), py("evaluate", "/job/x.py", 113), py("main", "/job/x.py", 9)),
            cpu_delta=2.0,
        ),
        look(
            1,
            "n",
            (py("forward", "/job/x.py", 20), py("evaluate", "/job/x.py", 112), py("main", "/job/x.py", 9)),
            cpu_delta=2.0,
        ),
    ]
    # WHEN
    decision = detect.decide(ranks, STALL)
    # THEN
    assert decision.kind == "busy"
    assert (
        decision.conclusion == "no step for 80 s: all ranks in evaluate (/job/x.py:113), moving (CPU +2.0 s in 3.0 s)"
    )


def test_a_cuda_synchronize_read_natively_only_the_second_time_is_the_odd_wait():
    # GIVEN ranks 0-2 waiting in all_reduce, and rank 3 seen first in Python only (in torch's
    # synchronize), then read natively (the look reads natively the ranks not in a collective):
    # the same Python frames, now in cuCtxSynchronize, its CPU spinning in the driver's wait
    sync = py("synchronize", "/venv/lib/python3.12/site-packages/torch/cuda/__init__.py", 1162)
    python_only = (sync, py("wait_for_kernel", "/job/train.py", 28))
    # (the driver's spinning wait caught in the vDSO's clock, as py-spy reads it)
    native = (
        Frame("__vdso_clock_gettime", "", 0, native=True, library="[vdso: 2277]"),
        Frame("???", "", 0, native=True, library="/usr/lib/libcuda.so.580"),
        Frame("cuCtxSynchronize_v2", "", 0, native=True, library="/usr/lib/libcuda.so.580"),
        *python_only,
    )
    looks = [look(r, "node-1", ALL_REDUCE) for r in range(3)]
    looks.append(look(3, "node-2", python_only, native, cpu_delta=3.0))
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN a hang naming rank 3 with its native frame, not a rank that moves
    assert decision.kind == "hang"
    assert [(c.rank, c.host) for c in decision.culprits] == [(3, "node-2")]
    assert (
        decision.culprits[0].where
        == "wait_for_kernel (/job/train.py:28) [native: cuCtxSynchronize_v2 [libcuda.so.580]]"
    )
    assert decision.states[3].state == "waiting-gpu"


# -- waiting for the GPU: the main thread's stacks as py-spy read them on an H200 (CUDA 13, driver
# 580), one per way a rank blocks behind a kernel that does not end (tests/data/gpu_stacks).
GPU_STACKS = Path(__file__).resolve().parents[1] / "data" / "gpu_stacks"
GPU_CASES = {
    # fault: (call, op, the program's line)
    "item": ("a device-to-host copy", "Tensor.item", 42),
    "cpu": ("a device-to-host copy", "Tensor.cpu", 44),
    "tolist": ("a device-to-host copy", "Tensor.tolist", 46),
    "cuda-sync": ("a device synchronize", "torch.cuda.synchronize", 48),
    "event-sync": ("an event synchronize", "Event.synchronize", 52),
    "stream-sync": ("a stream synchronize", "Stream.synchronize", 54),
    "h2d-pageable": ("a host-to-device copy", "Tensor.to", 57),
}


# The checkout the stacks were read in; its files are this checkout's (short_path makes them
# relative to the working directory, which is wherever the suite runs from).
GPU_STACKS_ROOT = "/work/main/"


def _gpu_stack(fault: str) -> list[Frame]:
    text = (GPU_STACKS / f"{fault}.json").read_text()
    text = text.replace(GPU_STACKS_ROOT, f"{Path(__file__).resolve().parents[2]}/")
    (thread,) = parse_py_spy(json.loads(text), pid=1)
    return list(thread.frames)


@pytest.mark.parametrize("fault", sorted(GPU_CASES))
def test_a_rank_blocked_behind_its_gpu_waits_for_its_gpu_whatever_cpu_it_spins(fault):
    # GIVEN rank 1 seen first in Python only, then natively in a blocking CUDA call (its CPU
    # spinning in the driver), ranks 0 and 2 waiting in all_reduce
    native = _gpu_stack(fault)
    python_only = tuple(f for f in native if not f.native)
    looks = [
        look(0, "n", ALL_REDUCE),
        look(2, "n", ALL_REDUCE),
        look(1, "n", python_only, tuple(native), cpu_delta=2.9),
    ]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN rank 1 waits for its GPU, in words, and is the hang's one culprit
    call, op, line = GPU_CASES[fault]
    state = next(s for s in decision.states if s.rank == 1)
    assert state.state == "waiting-gpu", (state.state, state.detail)
    assert state.gpu_call == f"{call} ({op} at tests/gpu/programs/gpu_fault_program.py:{line})"
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert f"rank 1 on n waits for its GPU in {call} ({op} at " in decision.conclusion
    assert "since step 100; the other 2 ranks wait in all_reduce" in decision.conclusion
    assert "moving" not in decision.conclusion
    assert state.where.startswith("block_behind_kernel (") and "[native: " in state.where


# -- held in a GPU library: decided by the library, the samples and the GPU's side -------------------
LIBCUDA = "/usr/local/nvidia/lib64/libcuda.so.580.159.04"
LIBCUDART = "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
LIBTORCH_CUDA = "/opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so"
LIBTORCH_PY = "/opt/venv/lib/python3.12/site-packages/torch/lib/libtorch_python.so"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
TRAIN = (py("train_step", "/job/train.py", 40), py("main", "/job/train.py", 99))


def native(function: str, library: str) -> Frame:
    return Frame(function, "", 0, native=True, library=library)


def stripped(n: int, library: str = LIBCUDA) -> list[Frame]:
    """``n`` frames of a stripped library, as py-spy reads them: addresses, no symbol."""
    return [native(f"0x7f89a45d{i:04x}", library) for i in range(n)]


# What a rank held in a GPU call shows natively, innermost first: every kind of library of the
# GPU's host side, with the symbols a stripped library gives (the nearest export, or none).
HELD = {
    # the case: a launch behind a full queue, the driver naming the nearest export
    "driver-launch-nearest-export": (
        [
            *stripped(6),
            native("cuLaunchKernel", LIBCUDA),
            *stripped(2, LIBCUDART),
            native("cudaLaunchKernel", LIBCUDART),
        ],
        "a call into the CUDA driver (cuLaunchKernel: a launch that does not return waits for a full queue)",
    ),
    "driver-no-symbol": (
        [*stripped(9)],
        "a call into the CUDA driver (no symbol, the nearest symbol: the call itself is not named)",
    ),
    "driver-unrelated-export": (
        [*stripped(4), native("cuGetProcAddress_v2", LIBCUDA)],
        "a call into the CUDA driver (cuGetProcAddress_v2, the nearest symbol: the call itself is not named)",
    ),
    "driver-under-a-futex": (  # a blocking-sync wait caught in libc, inside the driver
        [
            native("syscall", LIBC),
            native("pthread_cond_wait", LIBC),
            *stripped(3),
            native("cuEventSynchronize", LIBCUDA),
        ],
        "an event synchronize",
    ),
    "torch-cuda-copy": (
        [*stripped(3), native("at::native::copy_kernel_cuda", LIBTORCH_CUDA), native("THPVariable_cpu", LIBTORCH_PY)],
        "a copy between host and device",
    ),
    "torch-cuda-scalar": (
        [
            *stripped(5),
            native("cuMemcpyDtoHAsync_v2", LIBCUDA),
            native("at::native::_local_scalar_dense_cuda", LIBTORCH_CUDA),
        ],
        "a device-to-host copy",
    ),
    "nccl": (
        [*stripped(2), *stripped(3, "/usr/lib/libnccl.so.2.27.3"), native("ncclCommGetAsyncError", "libnccl.so.2")],
        "an NCCL call",
    ),
    "cublas": (
        [
            *stripped(4),
            native("cuLaunchKernel", LIBCUDA),
            native("cublasLtMatmul", "/nvidia/cublas/lib/libcublasLt.so.13"),
        ],
        "a cuBLAS call (cuLaunchKernel in the CUDA driver: its launches wait for a full queue, or it waits for the device)",
    ),
    "cudnn": (
        [*stripped(4), native("cudnnBackendExecute", "/site-packages/nvidia/cudnn/lib/libcudnn_graph.so.9")],
        "a cuDNN call (cudnnBackendExecute in cuDNN: its launches wait for a full queue, or it waits for the device)",
    ),
    "unnamed-library-of-a-cuda-wheel": (
        [native("0x7f0000001234", "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvfoo.so.13")],
        "a call into libnvfoo.so.13 (no symbol, the nearest symbol: the call itself is not named)",
    ),
}


# the call as the program wrote it, where torch's binding says (the others: no binding in the stack)
HELD_OPS = {"torch-cuda-copy": "Tensor.cpu "}


def gpu_busy(step: int = 149, done: bool = True, util: int = 100, probe_done: bool | None = None) -> dict:
    """The GPU's side of a row: its last step's event (``done``), NVML's utilization, the probe."""
    from dynprof.watch.model import GpuReading, GpuStep

    return {
        "gpu_step": GpuStep(step=step, done=done, age_s=14.0, device=0, probe_done=probe_done, probe_age_s=2.0),
        "gpu": GpuReading(index=0, utilization_pct=util, used_bytes=1 << 30, total_bytes=80 << 30),
    }


@pytest.mark.parametrize("case", sorted(HELD))
def test_a_rank_held_in_any_gpu_library_while_its_gpu_runs_waits_for_its_gpu_at_once(case):
    # GIVEN rank 1 inside a GPU library (named or stripped) in both samples, the same Python frames,
    # no step, its driver spinning (CPU +3.9 s in the look), its GPU busy 100 % with its last step's
    # work finished (it runs work queued since); ranks 0 and 2 wait in all_reduce
    frames, call = HELD[case]
    held = (*frames, *TRAIN)
    looks = [
        look(0, "n", ALL_REDUCE),
        look(2, "n", ALL_REDUCE),
        look(1, "n", held, held, cpu_delta=3.9, **gpu_busy()),
    ]
    # WHEN the watch decides on its first look (no confirmation asked for or given)
    decision = detect.decide(looks, STALL, waiting_for_s=0.0, confirm_s=30.0)
    # THEN rank 1 waits for its GPU, in the call's words, and the hang is called at once
    state = next(s for s in decision.states if s.rank == 1)
    assert state.state == "waiting-gpu", (state.state, state.detail)
    said = f"{call} ({HELD_OPS.get(case, '')}at /job/train.py:40)"
    assert state.gpu_call == said
    assert state.detail.endswith("its GPU agrees: GPU 0 busy (100 %), its step 149's work finished"), state.detail
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert f"rank 1 on n waits for its GPU in {said}" in decision.conclusion
    assert "moving" not in decision.conclusion


def test_a_rank_held_in_a_gpu_library_whose_gpu_is_idle_and_done_says_both():
    # GIVEN rank 1 in the same driver call in both samples, but its GPU idle (0 %) and its last
    # step's work finished; ranks 0 and 2 wait in all_reduce
    held = (*stripped(4), native("cuLaunchKernel", LIBCUDA), *TRAIN)
    looks = [
        look(0, "n", ALL_REDUCE),
        look(2, "n", ALL_REDUCE),
        look(1, "n", held, held, cpu_delta=0.0, **gpu_busy(util=0, probe_done=True)),
    ]
    # WHEN the watch decides
    decision = detect.decide(looks, STALL, waiting_for_s=0.0, confirm_s=30.0)
    # THEN rank 1 is the culprit, held on the host in the GPU library, both sides said
    state = next(s for s in decision.states if s.rank == 1)
    assert state.state == "in-gpu-library", state.detail
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]
    assert (
        "rank 1 on n is held in a call into the CUDA driver (cuLaunchKernel: a launch that does not return waits "
        "for a full queue) (at /job/train.py:40), not in the all_reduce the others wait in, but its GPU has nothing "
        "to wait for (GPU 0 idle (0 %), the work queued 2.0 s ago finished, its step 149's work finished): the call "
        "waits on the host, not on the device since step 100"
    ) in decision.conclusion
    assert state.row()["state"].startswith("held on the host in a call into the CUDA driver")
    assert "waits for its GPU" not in decision.conclusion


def test_every_rank_waiting_for_its_gpu_is_a_hang_on_the_devices_once_confirmed():
    # GIVEN both ranks in a device synchronize behind a kernel that does not end
    native = _gpu_stack("cuda-sync")
    python_only = tuple(f for f in native if not f.native)
    looks = [look(r, "n", python_only, tuple(native), cpu_delta=3.0) for r in range(2)]
    # WHEN seen for 2 s of the 10 asked, then for 12 s
    early = detect.decide(looks, STALL, waiting_for_s=2.0, confirm_s=10.0)
    late = detect.decide(looks, STALL, waiting_for_s=12.0, confirm_s=10.0)
    # THEN pending first, then a hang on the devices that points at the flight recorder
    assert early.kind == "pending"
    assert late.kind == "hang" and sorted(c.rank for c in late.culprits) == [0, 1]
    assert "every rank waits for its GPU" in late.conclusion and "the hang is on the devices" in late.conclusion
    assert "--flight-recorder" in late.conclusion


def test_one_waiting_rank_reads_the_other_rank_waits():
    looks = [look(0, "n", ALL_REDUCE), look(1, "n", (py("load", "/job/data.py", 5),))]
    decision = detect.decide(looks, STALL)
    assert "; the other rank waits in all_reduce at" in decision.conclusion, decision.conclusion


# -- two ranks in two different waits: decided on evidence, never by rank number ------------------
BARRIER_AFTER_LOOP = (py("barrier", DIST, 4150), py("main", "/job/train.py", 208))
GRADS_ALL_REDUCE = (py("all_reduce", DIST, 2806), py("main", "/job/train.py", 188))


@pytest.mark.parametrize("early", [0, 1])
def test_the_rank_that_left_the_loop_for_a_barrier_is_named_whatever_its_number(early):
    # GIVEN two ranks at the same step: one (rank `early`) ran out of data and waits in the
    # barrier after the loop, the other waits in the gradients' all_reduce inside it
    late = 1 - early
    looks = [look(early, "n", BARRIER_AFTER_LOOP), look(late, "n", GRADS_ALL_REDUCE)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN the rank that left the loop is the culprit, and the other is not named
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [early], decision.conclusion
    assert decision.conclusion.startswith(
        f"rank {early} on n waits in barrier at main (/job/train.py:208) since step 100: it left the loop"
    ), decision.conclusion
    assert "the other rank waits in all_reduce at main (/job/train.py:188)" in decision.conclusion


@pytest.mark.parametrize("behind", [0, 1])
def test_of_two_ranks_in_two_collectives_the_one_with_fewer_steps_is_behind(behind):
    # GIVEN two ranks in two different all_reduces, rank `behind` one step behind the other
    other = (py("all_reduce", DIST, 2806), py("report_metrics", "/job/train.py", 129), py("main", "/job/train.py", 99))
    looks = [
        look(behind, "n", ALL_REDUCE, step=41),
        look(1 - behind, "n", other, step=42),
    ]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN the rank behind is the culprit, with its steps and the other's
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [behind], decision.conclusion
    assert "it is behind: 41 steps where the others made 42" in decision.conclusion
    assert decision.culprits[0].since_step == 41


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_ranks_in_two_collectives_with_nothing_to_tell_them_apart_name_no_rank(order):
    # GIVEN two ranks at the same step in two different all_reduces (no barrier, no flight recorder)
    other = (py("all_reduce", DIST, 2806), py("report_metrics", "/job/train.py", 129), py("main", "/job/train.py", 99))
    a, b = order
    looks = [look(a, "n", ALL_REDUCE), look(b, "n", other)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN a hang that names no rank and says both positions
    assert decision.kind == "hang" and decision.culprits == [], decision.conclusion
    assert "cannot tell which holds the others" in decision.conclusion
    assert f"rank {a} on n waits in all_reduce at train_step (/job/train.py:40)" in decision.conclusion
    assert f"rank {b} on n waits in all_reduce at report_metrics (/job/train.py:129)" in decision.conclusion
    assert "--flight-recorder" in decision.conclusion


def test_two_ranks_in_two_collectives_follow_the_flight_recorder_first():
    # GIVEN the tie above, and the flight recorder saying rank 1 never enqueued rank 0's collective
    other = (py("all_reduce", DIST, 2806), py("report_metrics", "/job/train.py", 129), py("main", "/job/train.py", 99))
    looks = [look(0, "n", BARRIER_AFTER_LOOP), look(1, "n", other)]
    fr = {"process_groups": [{"hung": True, "missing": [1], "no_dump": [], "collective": "#77 barrier"}]}
    # WHEN
    decision = detect.decide(looks, STALL, flight_recorder=fr)
    # THEN the flight recorder's missing rank, not the barrier rule
    assert [c.rank for c in decision.culprits] == [1], decision.conclusion


def test_the_step_counts_break_only_a_tie_a_lone_rank_a_step_ahead_in_another_wait_is_the_odd_one():
    # GIVEN three ranks at step 99 in the metrics all_reduce, and rank 3 a step ahead in the next
    # step's all_reduce (it skipped the metrics collective)
    metrics = (
        py("all_reduce", DIST, 2806),
        py("report_metrics", "/job/train.py", 129),
        py("main", "/job/train.py", 99),
    )
    looks = [look(r, "n", metrics, step=99) for r in range(3)] + [look(3, "n", ALL_REDUCE, step=100)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN the lone rank is named, not the three "behind"
    assert [c.rank for c in decision.culprits] == [3], decision.conclusion
    assert "behind" not in decision.conclusion


def test_ranks_that_left_the_loop_together_are_named_together():
    # GIVEN ranks 0 and 1 in the barrier after the loop, ranks 2 and 3 in the next all_reduce
    looks = [look(r, "n", BARRIER_AFTER_LOOP) for r in (0, 1)] + [look(r, "n", GRADS_ALL_REDUCE) for r in (2, 3)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN ranks 0-1 are named, in their barrier
    assert [c.rank for c in decision.culprits] == [0, 1], decision.conclusion
    assert decision.conclusion.startswith(
        "ranks 0-1 on n wait in barrier at main (/job/train.py:208) since step 100: they left the loop"
    ), decision.conclusion


WAIT_FOR_BATCH = (py("get", "/usr/lib/python3.11/queue.py", 180), py("next_batch", "/job/data.py", 20), py("main"))


def test_no_rank_moving_outside_a_collective_is_a_hang_only_once_confirmed():
    # GIVEN every rank in the same place outside any collective, no CPU spent across the look
    # (a deadlock on a dead worker's queue; or a busy phase's workers starved of CPU for a while)
    looks = [look(r, "node-1" if r < 2 else "node-2", WAIT_FOR_BATCH) for r in range(4)]
    # WHEN the watch decides after one look, then with the same ranks seen there for the confirm time
    first = detect.decide(looks, STALL, None, 0.0, confirm_s=30.0)
    later = detect.decide(looks, STALL, None, 31.0, confirm_s=30.0)
    # THEN one look is not yet a hang; the same ranks still there past the confirm time are
    assert [s.state for s in first.states] == ["parked"] * 4
    assert first.kind == "pending" and "no rank moves" in first.conclusion, first.conclusion
    assert "not called a hang yet" in first.conclusion
    assert first.waiting_key is not None and len(first.waiting_key) == 4
    assert later.kind == "hang" and "no rank moves" in later.conclusion and len(later.culprits) == 4
    # AND a rank that moved meanwhile makes it busy, never a hang
    moved = [*looks[:3], look(3, "node-2", WAIT_FOR_BATCH, cpu_delta=1.0)]
    assert detect.decide(moved, STALL, None, 31.0, confirm_s=30.0).kind == "busy"


# -- waiting in a collective: decided by where the main thread is, not by a list of names --------
# The main thread of rank 0 of a 2-rank gloo job (torch 2.13, CPU) blocked in each call while
# rank 1 never comes, as py-spy read it natively (tests/data/record_comm_stacks.py).
COMM_STACKS = Path(__file__).resolve().parents[1] / "data" / "comm_stacks"
COMM_CASES = {
    # way: the collective the verdict names (the call the program made into communication code)
    "all_gather_into_tensor": "all_gather_into_tensor",  # torch 2.13 calls all_gather_single inside it
    "reduce_scatter": "reduce_scatter",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier",
    "recv": "recv",
    "irecv_wait": "c10d::ProcessGroupGloo::RecvWork::wait",  # work.wait() in the program: C frames only
    "functional_wait": "wait",  # AsyncCollectiveTensor.wait -> wait_tensor
    "c10d_op": "c10d::wait_tensor",  # torch.ops._c10d_functional.* called by the program itself
}
LOAD = (py("load_next_batch", "/job/data.py", 88), py("main", "/job/train.py", 90))


def _comm_stack(way: str) -> list[Frame]:
    (thread,) = parse_py_spy(json.loads((COMM_STACKS / f"{way}.json").read_text()), pid=1)
    return list(thread.frames)


@pytest.mark.parametrize("way", sorted(COMM_CASES))
def test_a_rank_in_any_call_into_communication_code_waits_in_a_collective(way):
    # GIVEN ranks 0-2 blocked in the recorded call (seen in Python only first, then natively),
    # and rank 3 parked in load_next_batch
    native = _comm_stack(way)
    python_only = tuple(f for f in native if not f.native)
    looks = [look(r, "n", python_only, tuple(native)) for r in range(3)]
    looks.append(look(3, "n", LOAD))
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN ranks 0-2 wait in the call, named as the program made it, and rank 3 is the culprit
    assert [s.state for s in decision.states] == ["waiting", "waiting", "waiting", "parked"], [
        s.detail for s in decision.states
    ]
    assert {s.collective for s in decision.states[:3]} == {COMM_CASES[way]}
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [3]
    assert decision.states[0].where.startswith("block (/job/comm_wait_program.py:")
    assert f"the other 3 ranks wait in {COMM_CASES[way]} at block (" in decision.conclusion


LIBMPI = "/usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so.40"
LIBOPAL = "/usr/lib/x86_64-linux-gnu/openmpi/lib/libopen-pal.so.40"
MPI4PY = "/venv/lib/python3.11/site-packages/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so"


def mpi_stack(call: str, at: int) -> tuple[Frame, ...]:
    """A rank in an MPI call from mpi4py, as a native read shows Open MPI: its progress loop
    (libopen-pal, spinning), the library's own machinery, the call the program made."""
    return (
        native("opal_progress", LIBOPAL),
        native("ompi_request_default_wait_all", LIBMPI),
        native("ompi_coll_base_allreduce_intra_recursivedoubling", LIBMPI),
        native(f"P{call}", LIBMPI),
        native(f"__pyx_pw_6mpi4py_3MPI_9Intracomm_{call[4:]}", MPI4PY),
        py("sync_grads", "/job/train.py", at),
        py("main", "/job/train.py", 99),
    )


def test_a_rank_spinning_in_mpi_waits_in_its_collective_not_moves():
    # GIVEN ranks 0-2 in MPI_Allreduce (Open MPI spins: CPU +2.9 s in the look), rank 3 parked
    mpi = mpi_stack("MPI_Allreduce", 30)
    looks = [look(r, "n", mpi, cpu_delta=2.9) for r in range(3)] + [look(3, "n", LOAD)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN they wait in the call the program made, and rank 3 holds them
    assert [s.state for s in decision.states[:3]] == ["waiting"] * 3
    assert decision.states[0].collective == "PMPI_Allreduce"
    assert decision.states[0].where == "sync_grads (/job/train.py:30) [native: PMPI_Allreduce [libmpi.so.40]]"
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [3]


def test_a_rank_in_any_barrier_left_the_loop_the_others_are_in():
    # GIVEN rank 0 in MPI_Barrier after the loop, rank 1 in the loop's MPI_Allreduce, the same step
    looks = [look(0, "n", mpi_stack("MPI_Barrier", 208)), look(1, "n", mpi_stack("MPI_Allreduce", 30))]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN the barrier's rank is named: a barrier carries no data, it only meets the others
    assert [c.rank for c in decision.culprits] == [0], decision.conclusion
    assert "it left the loop the others are in (a PMPI_Barrier after it)" in decision.conclusion
    assert detect.meets_only("_store_based_barrier") and detect.meets_only("c10d::ProcessGroupGloo::barrier")
    assert not detect.meets_only("all_reduce") and not detect.meets_only(None)


LIBNCCL = "/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"


def test_a_stripped_nccl_is_named_by_the_call_into_it_never_by_its_nearest_export():
    # GIVEN NCCL's frames as a stripped library shows them (addresses, and an unrelated export)
    inside = [*stripped(3, LIBNCCL), native("ncclCommGetAsyncError", LIBNCCL)]
    from_c10d = (*inside, native("c10d::ProcessGroupNCCL::allreduce", LIBTORCH_CUDA), *TRAIN)
    alone = (*inside, *TRAIN)
    # WHEN / THEN the call into it is named where torch's code made it, and said unnamed otherwise
    assert frame_rules.collective_of(from_c10d) == "c10d::ProcessGroupNCCL::allreduce"
    assert frame_rules.collective_of(alone) == "a call into libnccl.so.2 (stripped: the call is not named)"
    # AND a rank in _CoalescingManager.wait (torch.distributed, NCCL spinning under it) waits in it
    coalesced = (*inside, py("_CoalescingManager.wait", DIST, 2620), *TRAIN)
    looks = [look(r, "n", coalesced, cpu_delta=2.9, **gpu_busy()) for r in range(3)] + [look(3, "n", LOAD)]
    decision = detect.decide(looks, STALL)
    assert [s.state for s in decision.states[:3]] == ["waiting"] * 3, [s.detail for s in decision.states]
    assert decision.states[0].collective == "wait"
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [3]


def test_the_rest_of_torch_distributed_is_judged_by_what_it_does():
    # GIVEN every rank writing a distributed checkpoint in torch.distributed.checkpoint, no CPU,
    # in disk I/O (a slow file system's write), and the same frames in both samples
    dcp = (
        py("_write_files_from_queue", "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py"),
        py("save", "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict_saver.py"),
        py("save_checkpoint", "/job/train.py", 210),
    )
    looks = [look(r, "n", dcp, process_state="disk-sleep") for r in range(4)]
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN busy: it is no collective (not the communication API), it works at the disk
    assert decision.kind == "busy" and [s.state for s in decision.states] == ["moving"] * 4
    assert frame_rules.collective_of(dcp) is None
    assert decision.conclusion == (
        "no step for 80 s: all ranks in save_checkpoint (/job/train.py:210), moving (in disk I/O (process state D))"
    )


def test_a_busy_verdict_says_what_was_measured_of_each_group():
    # GIVEN ranks in save_checkpoint: two seen in disk I/O, two that wrote 8 MB and spent 0.5 s of CPU
    looks = checkpoint_writers(writers_cpu_delta=0.5)
    # WHEN
    decision = detect.decide(looks, STALL)
    # THEN each fact once, with how many ranks showed it
    assert decision.conclusion == (
        "no step for 80 s: all ranks in save_checkpoint (/job/train.py:210), moving "
        "(2 of 4: CPU +0.5 s in 3.0 s, 2 of 4: I/O +8.0 MB, 2 of 4: in disk I/O (process state D))"
    )


# -- the flight recorder: the group the watch sees, every kind of evidence it holds ---------------
def _pg(waiting, missing=(), mismatched=(), no_dump=(), collective="#12 gloo:all_reduce"):
    return {
        "hung": True,
        "waiting": list(waiting),
        "missing": list(missing),
        "mismatched": [{"rank": r, "collective": c} for r, c in mismatched],
        "no_dump": list(no_dump),
        "collective": collective,
        "verdict": "...",
    }


def test_the_flight_recorder_group_read_is_the_one_whose_waiting_ranks_the_stacks_see():
    # GIVEN two hung groups: a side group (ranks 4-5 wait, 6 missing) listed first, and the world
    # group where ranks 0-2 wait and rank 3 never enqueued #12
    fr = {"process_groups": [_pg([4, 5], [6], collective="#3 gloo:broadcast"), _pg([0, 1, 2], [3])]}
    looks = [look(r, "n", ALL_REDUCE) for r in range(4)]
    # WHEN
    decision = detect.decide(looks, STALL, flight_recorder=fr)
    # THEN rank 3 of the group the stacks show waiting, not the first group's rank 6
    assert [c.rank for c in decision.culprits] == [3], decision.conclusion
    assert "flight recorder: missing rank 3 in #12 gloo:all_reduce" in decision.conclusion


def test_the_flight_recorder_names_a_rank_that_enqueued_another_collective():
    # GIVEN every rank in all_reduce, the recorder saying rank 2's #12 is a broadcast
    fr = {"process_groups": [_pg([0, 1, 3], mismatched=[(2, "#12 gloo:broadcast")])]}
    looks = [look(r, "n", ALL_REDUCE) for r in range(4)]
    # WHEN
    decision = detect.decide(looks, STALL, flight_recorder=fr)
    # THEN rank 2 is named, with what it enqueued
    assert [c.rank for c in decision.culprits] == [2], decision.conclusion
    assert decision.culprits[0].why == (
        "enqueued #12 gloo:broadcast where the others enqueued #12 gloo:all_reduce (flight recorder)"
    )
    assert "rank 2 enqueued #12 gloo:broadcast where the others wait in #12 gloo:all_reduce" in decision.conclusion


def test_a_rank_without_a_flight_recorder_dump_is_said_as_such_never_as_missing():
    # GIVEN every rank in all_reduce, and no dump from rank 3 (nothing else in the recorder)
    fr = {"process_groups": [_pg([0, 1, 2], no_dump=[3])]}
    looks = [look(r, "n", ALL_REDUCE) for r in range(4)]
    # WHEN
    reading = detect.flight_recorder_reading(fr, [0, 1, 2, 3])
    decision = detect.decide(looks, STALL, flight_recorder=fr)
    # THEN it is named as the rank the recorder could not read
    assert reading.culprits == {3: "gave the flight recorder no dump while the others wait (flight recorder)"}
    assert "flight recorder: no dump from rank 3 while the others wait in #12 gloo:all_reduce" in decision.conclusion
    assert "missing" not in decision.conclusion
    # AND a rank missing beside it is named alone: a missing rank is evidence, no dump is not
    both = detect.flight_recorder_reading({"process_groups": [_pg([0, 1], missing=[2], no_dump=[3])]})
    assert list(both.culprits) == [2]


def test_a_flight_recorder_analysis_of_the_wrong_shape_says_nothing():
    # GIVEN analyses that are not what the recorder writes (read back from a node: untrusted)
    for bad in (None, [], {"process_groups": {"0": {}}}, {"process_groups": [1, "x", {"hung": True}]}):
        # WHEN it is read
        reading = detect.flight_recorder_reading(bad, [0, 1])  # type: ignore[arg-type]
        # THEN no rank is named, nothing raises
        assert reading.culprits == {}
    hung = {"process_groups": [{"hung": True, "missing": "2", "mismatched": {"rank": 1}, "verdict": "v"}]}
    assert detect.flight_recorder_reading(hung) == detect.FlightRecorderReading(text="flight recorder: v")
