"""One rank's state in a look (dynprof.watch.classify) from crafted progress rows and stack samples."""

from __future__ import annotations

import pytest

from collectors.stacks import Frame
from dynprof.watch import classify
from dynprof.watch import frames as frame_rules
from tests.unit.test_watch_detect import LIBC, LIBCUDA, TRAIN, gpu_busy, look, native, py, stripped


def test_a_few_kilobytes_of_io_do_not_make_a_parked_rank_move():
    # GIVEN a rank parked in load_next_batch whose agent answered status requests (a few kB)
    frames = (py("load_next_batch", "/job/data.py", 77),)
    (lk,) = [look(3, "n", frames, cpu_delta=0.0)]
    assert lk.after is not None
    lk.before.io_bytes, lk.after.io_bytes = 5_000, 9_000
    # WHEN / THEN still parked
    assert classify.classify(lk).state == "parked"


@pytest.mark.parametrize("gpu", ["unfinished-step", "unfinished-probe", "busy"])
def test_the_gpu_side_agrees_by_unfinished_work_or_a_busy_device(gpu):
    # GIVEN a rank held in a stripped driver call, its GPU's side saying it has work in one way
    side = {
        "unfinished-step": gpu_busy(done=False, util=0),
        "unfinished-probe": gpu_busy(done=True, util=0, probe_done=False),
        "busy": gpu_busy(done=True, util=97),
    }[gpu]
    held = (*stripped(5), *TRAIN)
    # WHEN it is classified
    state = classify.classify(look(1, "n", held, held, cpu_delta=2.0, **side))
    # THEN it waits for its GPU, its GPU agreeing
    assert state.state == "waiting-gpu" and "its GPU agrees: " in state.detail, state.detail


def test_a_rank_held_in_a_gpu_library_with_no_gpu_side_read_says_it_judged_from_its_stack():
    # GIVEN a rank in a stripped driver call in both samples, no GPU step and no NVML reading
    held = (*stripped(5), *TRAIN)
    # WHEN it is classified
    state = classify.classify(look(1, "n", held, held, cpu_delta=2.0))
    # THEN it waits for its GPU, and says the GPU's side was not read
    assert state.state == "waiting-gpu"
    assert "judged from its stack alone: no reading of its device (its device not read)" in state.detail


def test_a_rank_in_libc_poll_is_not_waiting_for_its_gpu():
    # GIVEN a rank in poll (libc) under Python's select, and one in poll under gloo, in both samples
    in_select = (
        native("poll", LIBC),
        native("0x55d1", "/usr/lib/python3.12/lib-dynload/select.cpython-312.so"),
        py("select", "/usr/lib/python3.12/selectors.py", 415),
        *TRAIN,
    )
    in_gloo = (native("poll", LIBC), native("gloo::transport::tcp::Loop::run", "/torch/lib/libgloo.so"), *TRAIN)
    for frames in (in_select, in_gloo):
        # WHEN it is classified, its GPU busy
        state = classify.classify(look(1, "n", frames, frames, cpu_delta=0.0, **gpu_busy()))
        # THEN it is no GPU wait (parked, where it is)
        assert frame_rules.gpu_wait_of(frames) is None
        assert state.state not in ("waiting-gpu", "in-gpu-library"), state.state
    # nor is a stack whose innermost frame is Python, or a library of the program's over the runtime
    assert frame_rules.gpu_wait_of((py("step"),)) is None
    ext = Frame("spin", "", 0, native=True, library="/usr/lib/libmyext.so")
    assert frame_rules.gpu_wait_of((ext, native("cudaStreamSynchronize", "libcudart.so"))) is None


def test_a_gpu_call_not_held_across_the_look_is_not_a_wait():
    # GIVEN a rank in a launch in both samples but at different lines, one whose first sample was
    # read natively outside any GPU library, and one that made a step in between
    launch = (*stripped(3), native("cuLaunchKernel", LIBCUDA))
    at40 = (*launch, *TRAIN)
    at41 = (*launch, py("train_step", "/job/train.py", 41), TRAIN[1])
    elsewhere = (native("memcpy", LIBC), native("at::native::add", "/torch/lib/libtorch_cpu.so"), *TRAIN)
    moved_lines = look(1, "n", at41, at40, cpu_delta=3.0, **gpu_busy())
    elsewhere_first = look(1, "n", elsewhere, at40, cpu_delta=3.0, **gpu_busy())
    stepped = look(1, "n", at40, at40, cpu_delta=3.0, **gpu_busy())
    assert stepped.after is not None
    stepped.after.step += 1
    # WHEN each is classified
    states = [classify.classify(x) for x in (moved_lines, elsewhere_first, stepped)]
    # THEN none is held in the GPU library: each moves
    assert [s.state for s in states] == ["moving", "moving", "moving"], [s.detail for s in states]
