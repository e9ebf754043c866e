"""Grouping and rendering of many processes' stacks, and the readers' parsers, on recorded data."""

from __future__ import annotations

import faulthandler
import os
import threading

from collectors.stacks.merge import group_processes
from collectors.stacks.model import Frame, ProcessStacks, ThreadStack, headline, rank_labels, short_symbol
from collectors.stacks.readers import parse_faulthandler, parse_py_spy
from collectors.stacks.render import render_merged

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _proc(rank: int, frames: list[Frame], pid: int | None = None, gil: bool = False) -> ProcessStacks:
    pid = pid or 1000 + rank
    return ProcessStacks(
        pid=pid,
        method="py-spy",
        rank=rank,
        threads=[
            ThreadStack(tid=pid + 1, name="worker", frames=[Frame("idle", "/x/t.py", 1)]),
            ThreadStack(tid=pid, name="MainThread", main=True, holds_gil=gil, frames=frames),
        ],
    )


def _waiting() -> list[Frame]:
    return [
        Frame("all_reduce", C10D, 2806),
        Frame("train_step", "/job/train.py", 120),
        Frame("main", "/job/train.py", 200),
    ]


def _loading() -> list[Frame]:
    return [
        Frame("DataLoader.__next__", "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", 631),
        Frame("train_step", "/job/train.py", 88),
        Frame("main", "/job/train.py", 200),
    ]


def test_seven_waiting_ranks_and_one_outlier_form_two_groups():
    # GIVEN ranks 0-6 waiting in all_reduce and rank 7 in the data loader
    procs = [_proc(r, _waiting()) for r in range(7)] + [_proc(7, _loading(), gil=True)]

    # WHEN grouped
    groups = group_processes(reversed(procs))

    # THEN the largest group comes first and the outlier names the frame where it departs
    assert [g.labels for g in groups] == ["ranks 0-6", "rank 7"]
    assert (
        groups[0].headline()
        == "in all_reduce (torch/distributed/distributed_c10d.py:2806) <- train_step (/job/train.py:120)"
    )
    assert groups[1].outlier and not groups[0].outlier
    assert groups[1].diverges_at is not None and groups[1].reference_at is not None
    assert (groups[1].diverges_at.line, groups[1].reference_at.line) == (88, 120)
    text = render_merged(procs, groups)
    assert "ranks 0-6: in all_reduce" in text
    assert "rank 7: in DataLoader.__next__" in text and "<- outlier" in text
    assert "differs from group 1 at: train_step (/job/train.py:88)" in text
    assert "main thread holds the GIL in: rank 7" in text


def test_equal_groups_have_no_outlier_and_order_by_lowest_rank():
    procs = [_proc(1, _loading()), _proc(0, _waiting())]
    groups = group_processes(procs)
    assert [g.labels for g in groups] == ["rank 0", "rank 1"]
    assert not groups[1].outlier


def test_native_frames_group_by_symbol_not_address():
    a = _proc(0, [Frame("0x7f01", "/lib/libc.so.6", native=True, library="/lib/libc.so.6"), *_waiting()])
    b = _proc(1, [Frame("0x7f01", "/lib/libc.so.6", native=True, library="/usr/lib/libc.so.6"), *_waiting()])
    assert len(group_processes([a, b])) == 1


def test_headline_names_the_native_wait_of_the_program_libraries():
    frames = [
        Frame("pthread_cond_wait", "", native=True, library="/lib/libc.so.6"),
        Frame(
            "c10d::ProcessGroupNCCL::WorkNCCL::synchronize()",
            "",
            native=True,
            library="/venv/torch/lib/libtorch_cuda.so",
        ),
        *_waiting(),
    ]
    assert headline(frames).endswith("[native: c10d::ProcessGroupNCCL::WorkNCCL::synchronize()]")


def test_rank_labels_compress_ranges_and_list_pids_without_ranks():
    procs = [_proc(r, []) for r in (0, 1, 2, 5, 7, 8)] + [ProcessStacks(pid=42, method="agent")]
    assert rank_labels(procs) == "ranks 0-2,5,7-8 + pid 42"


def test_short_symbol_collapses_templates():
    sym = "c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)" + "x" * 60
    assert short_symbol(sym).startswith("c10d::Work::wait(...)")
    assert len(short_symbol("a" * 300)) == 100


def test_parse_py_spy_recorded_output():
    # Recorded from `py-spy dump --json --native` (0.4.3) of a sleeping process.
    data = [
        {
            "pid": 7778,
            "thread_id": 1,
            "thread_name": "MainThread",
            "os_thread_id": 7778,
            "active": False,
            "owns_gil": True,
            "frames": [
                {
                    "name": "clock_nanosleep",
                    "filename": "/usr/lib/x86_64-linux-gnu/libc.so.6",
                    "module": "/usr/lib/x86_64-linux-gnu/libc.so.6",
                    "short_filename": "libc.so.6",
                    "line": 0,
                    "locals": None,
                },
                {
                    "name": "<module>",
                    "filename": "<string>",
                    "module": None,
                    "short_filename": "<string>",
                    "line": 7,
                    "locals": [{"name": "x", "addr": 1, "arg": False, "repr": "3"}],
                },
            ],
        },
        {
            "pid": 7778,
            "thread_id": 2,
            "thread_name": "worker-1",
            "os_thread_id": 7780,
            "active": True,
            "owns_gil": False,
            "frames": [{"name": "f", "filename": "<string>", "module": None, "line": 4}],
        },
    ]
    threads = parse_py_spy(data, 7778)
    main = threads[0]
    assert main.main and main.holds_gil and main.name == "MainThread"
    assert main.frames[0].native and main.frames[0].library.endswith("libc.so.6")
    assert not main.frames[1].native and main.frames[1].locals == {"x": "3"}
    assert not threads[1].main and threads[1].active


def test_parse_faulthandler_real_dump(tmp_path):
    # GIVEN a real faulthandler dump of this process, with a named thread blocked in a function
    stop = threading.Event()

    def blocked_in_here() -> None:
        stop.wait(30)

    t = threading.Thread(target=blocked_in_here, name="blocker")
    t.start()
    try:
        path = tmp_path / "dump.txt"
        with open(path, "w") as fh:
            faulthandler.dump_traceback(fh, all_threads=True)
        names = {th.ident: (th.name, th.native_id) for th in threading.enumerate()}
        # WHEN parsed
        threads = parse_faulthandler(path.read_text(), os.getpid(), names, threading.main_thread().ident)
    finally:
        stop.set()
        t.join()
    # THEN the main thread comes first and the blocked thread is named with its function
    assert threads[0].main and threads[0].tid == os.getpid()
    assert any(f.function == "test_parse_faulthandler_real_dump" for f in threads[0].frames)
    blocker = next(th for th in threads if th.name == "blocker")
    assert blocker.tid == t.native_id
    assert any(f.function == "blocked_in_here" for f in blocker.frames)


def test_headline_skips_unresolved_native_frames():
    # Recorded on the GPU machine (torch 2.11, CUDA 13): rank 0 in torch.cuda.synchronize.
    frames = [
        Frame("???", "", native=True, library="/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"),
        Frame("cuCtxSynchronize_v2", "", native=True, library="/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"),
        Frame("cudaDeviceSynchronize", "", native=True, library="/venv/lib/libcudart.so.13"),
        Frame("???", "", native=True, library="/usr/bin/python3.12"),
        Frame("synchronize", "/venv/lib/python3.12/site-packages/torch/cuda/__init__.py", 1162),
        Frame("collective_wait", "/job/hang_program.py", 39),
    ]
    assert headline(frames) == (
        "in synchronize (torch/cuda/__init__.py:1162) <- collective_wait (/job/hang_program.py:39)"
        " [native: cuCtxSynchronize_v2]"
    )
    assert headline(frames[3:]).endswith("(/job/hang_program.py:39)")
