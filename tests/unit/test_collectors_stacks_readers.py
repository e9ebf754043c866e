"""collectors/stacks/readers.py: finding the tools, py-spy's and faulthandler's output parsed into
threads innermost first, the agent's in-process reader, and the errors a person sees when a
method cannot read a process. No process is ptraced here."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from collectors.stacks import readers
from collectors.stacks.model import Frame
from collectors.stacks.readers import (
    CaptureError,
    capture_in_process,
    capture_py_spy,
    capture_pystack,
    find_tool,
    looks_like_python,
    parse_faulthandler,
    parse_py_spy,
    ptrace_refusal,
)


def test_a_capture_error_carries_its_method_and_reason():
    err = CaptureError("py-spy", "no answer within 10 s")
    assert (err.method, err.reason, str(err)) == ("py-spy", "no answer within 10 s", "py-spy: no answer within 10 s")


def test_the_variable_overrides_the_path_and_an_empty_one_means_no_tool(monkeypatch, tmp_path):
    # GIVEN DYNPROF_PY_SPY set to a path, then to ""
    monkeypatch.setenv("DYNPROF_PY_SPY", str(tmp_path / "my-py-spy"))
    # WHEN the tool is looked for
    # THEN the variable's path is taken as is, and "" says there is none
    assert find_tool("py-spy") == str(tmp_path / "my-py-spy")
    monkeypatch.setenv("DYNPROF_PY_SPY", "")
    assert find_tool("py-spy") is None


def test_a_tool_not_on_the_path_is_found_next_to_the_interpreter(monkeypatch, tmp_path):
    # GIVEN an empty PATH and a tool beside a (stand-in) interpreter
    monkeypatch.delenv("DYNPROF_SOME_TOOL", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "some-tool").write_text("")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    # WHEN looked for
    # THEN the one beside the interpreter is found, and one that is nowhere is None
    assert find_tool("some-tool") == str(tmp_path / "some-tool")
    assert find_tool("other-tool") is None


def test_reading_ones_own_memory_is_permitted_and_a_gone_process_is_left_to_the_reader():
    # GIVEN this process and a pid that cannot exist
    # WHEN asked whether ptrace would be refused
    # THEN neither is a refusal
    assert ptrace_refusal(os.getpid()) is None
    assert ptrace_refusal(2**22 + 1) is None


def test_this_interpreter_looks_like_python_and_a_gone_process_cannot_be_told():
    assert looks_like_python(os.getpid()) is True
    assert looks_like_python(2**22 + 1) is None


def test_py_spy_threads_are_parsed_with_native_frames_locals_and_the_main_thread():
    # GIVEN py-spy's JSON for a main thread in Python over a native frame, and a worker
    data = [
        {
            "os_thread_id": 41,
            "thread_name": "MainThread",
            "owns_gil": True,
            "active": True,
            "frames": [
                {"name": "ncclWait", "filename": "nccl.cc", "line": 0, "module": "/x/libnccl.so.2"},
                {"name": "step", "filename": "/job/t.py", "line": 7, "locals": [{"name": "i", "repr": "3"}, {}]},
            ],
        },
        {"os_thread_id": 42, "thread_name": "loader", "owns_gil": False, "active": False, "frames": []},
    ]
    # WHEN parsed for pid 41
    threads = parse_py_spy(data, 41)
    # THEN the native frame names its library, locals are kept by name, and the main thread is known
    main, worker = threads
    assert main.main and main.holds_gil and main.active is True and not worker.main
    assert main.frames[0] == Frame("ncclWait", "nccl.cc", 0, native=True, library="/x/libnccl.so.2")
    assert main.frames[1] == Frame("step", "/job/t.py", 7, locals={"i": "3"})
    assert (worker.tid, worker.name, worker.holds_gil, worker.frames) == (42, "loader", False, [])


def test_a_thread_named_mainthread_is_the_main_one_whatever_its_id():
    threads = parse_py_spy([{"os_thread_id": 7, "thread_name": "MainThread", "frames": []}], 1)
    assert threads[0].main


def test_faulthandlers_dump_is_parsed_with_the_main_thread_first_and_given_the_pid():
    # GIVEN faulthandler's text for a worker and (last, as faulthandler writes it) the main thread
    text = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/job/train.py", line 12 in step\n'
        '  File "/job/train.py", line ??? in main\n'
    )
    # WHEN parsed without names
    threads = parse_faulthandler(text, pid=500)
    # THEN the main thread comes first with the pid as its tid, and an unknown line is 0
    assert [t.main for t in threads] == [True, False]
    assert threads[0].tid == 500
    assert threads[0].frames == [Frame("step", "/job/train.py", 12), Frame("main", "/job/train.py", 0)]
    assert threads[1].frames == [Frame("wait", "/usr/lib/python3.11/threading.py", 320)]


def test_faulthandler_threads_take_the_names_and_ids_the_process_knows():
    # GIVEN a dump of two threads and the process's own names for them
    text = (
        "Thread 0x0000000000000010 [pt_autograd_0] (most recent call first):\n"
        '  File "/x.py", line 1 in f\n'
        "Thread 0x0000000000000020 (most recent call first):\n"
        '  File "/y.py", line 2 in g\n'
    )
    names = {0x10: ("autograd", 1234)}
    # WHEN parsed with the names and the main thread's ident
    threads = parse_faulthandler(text, pid=99, names=names, main_ident=0x20)
    # THEN the known thread has its name and native id, the main one is marked and has the pid
    by_name = {t.name: t for t in threads}
    assert by_name["autograd"].tid == 1234 and not by_name["autograd"].main
    main = threads[0]
    assert main.main and main.tid == 99


def test_the_in_process_reader_sees_every_thread_with_the_main_one_first():
    # GIVEN a second thread waiting on an event
    ready, done = threading.Event(), threading.Event()

    def park() -> None:
        ready.set()
        done.wait(5)

    worker = threading.Thread(target=park, name="parked-worker")
    worker.start()
    ready.wait(5)
    try:
        # WHEN this process reads its own stacks
        p = capture_in_process()
    finally:
        done.set()
        worker.join()
    # THEN it is this pid read by the agent, main thread first, the worker in `park`
    assert p.pid == os.getpid() and p.method == "agent" and p.notes
    assert p.threads[0].main
    parked = [t for t in p.threads if t.name == "parked-worker"]
    assert len(parked) == 1 and any(f.function.endswith("park") for f in parked[0].frames)
    assert parked[0].tid == worker.native_id


def test_the_in_process_reader_bounds_the_depth_and_the_repr_of_locals():
    # GIVEN a local whose repr is long, and one whose repr raises
    class Bad:
        def __repr__(self) -> str:
            raise ValueError("no")

    long_value = "x" * 1000  # noqa: F841 (read by the reader below)
    bad = Bad()  # noqa: F841
    # WHEN read with locals and a depth of 2 (the reader's own frame, then this test's)
    p = capture_in_process(locals=True, max_depth=2)
    # THEN no thread has more, and this frame's locals are cut, or shown by type (no repr of
    # the job's runs on the agent's thread)
    assert all(len(t.frames) <= 2 for t in p.threads)
    me = next(t for t in p.threads if t.active is True)
    assert me.frames[0].function == "capture_in_process"
    assert me.frames[1].function.endswith("test_the_in_process_reader_bounds_the_depth_and_the_repr_of_locals")
    local = me.frames[1].locals or {}
    assert len(local["long_value"]) == 200
    assert local["bad"].endswith("Bad>")


def test_py_spy_missing_is_said_in_a_persons_words(monkeypatch):
    # GIVEN no py-spy anywhere
    monkeypatch.setenv("DYNPROF_PY_SPY", "")
    # WHEN a capture is asked for
    # THEN the error names the method and how to install it
    with pytest.raises(CaptureError) as info:
        capture_py_spy(os.getpid())
    assert info.value.method == "py-spy" and "pip install py-spy" in info.value.reason


def test_a_failing_tools_first_message_line_is_the_reason_without_its_backtrace(monkeypatch, tmp_path):
    # GIVEN a "py-spy" that fails the way py-spy does: an error line and then a Rust backtrace
    tool = tmp_path / "py-spy"
    tool.write_text(
        "#!/bin/sh\n"
        "echo 'Error: Permission denied (os error 13)' >&2\n"
        "echo 'Stack backtrace:' >&2\n"
        "echo '0: something' >&2\n"
        "exit 1\n"
    )
    tool.chmod(0o755)
    monkeypatch.setenv("DYNPROF_PY_SPY", str(tool))
    # WHEN a capture is asked for
    with pytest.raises(CaptureError) as info:
        capture_py_spy(12345)
    # THEN the reason is the message alone
    assert info.value.reason == "Permission denied (os error 13)"


def test_py_spy_output_that_is_not_json_is_a_capture_error(monkeypatch, tmp_path):
    tool = tmp_path / "py-spy"
    tool.write_text("#!/bin/sh\necho 'not json'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("DYNPROF_PY_SPY", str(tool))
    with pytest.raises(CaptureError, match="unreadable output"):
        capture_py_spy(12345)


def test_pystack_output_that_is_not_a_process_dump_is_a_capture_error(monkeypatch, tmp_path):
    # GIVEN a stand-in interpreter for pystack that prints JSON of the wrong schema
    tool = tmp_path / "python"
    tool.write_text('#!/bin/sh\necho \'{"schema": "other", "pid": 1}\'\n')
    tool.chmod(0o755)
    monkeypatch.setenv("DYNPROF_PYSTACK_PYTHON", str(tool))
    # WHEN pystack is asked for a pid
    # THEN the capture error names the method and the decoder's reason
    with pytest.raises(CaptureError) as info:
        capture_pystack(12345)
    assert info.value.method == "pystack" and "unreadable output: not a dynprof stack dump" in info.value.reason


def test_a_tool_that_does_not_answer_in_time_is_a_capture_error(monkeypatch):
    # GIVEN a tool run that times out
    def run(*args, **kwargs):
        raise readers.subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(readers.subprocess, "run", run)
    monkeypatch.setenv("DYNPROF_PY_SPY", "/bin/py-spy-stand-in")
    # WHEN a capture is asked for
    # THEN it says how long it waited
    with pytest.raises(CaptureError, match="no answer within 2 s"):
        capture_py_spy(1, timeout=2)


def test_locals_read_in_process_run_none_of_the_jobs_code():
    # GIVEN locals of every kind: built-ins, a tensor, a module, and an object whose repr would run
    # the job's code (here: it counts its calls)
    import torch

    from collectors.stacks.readers import safe_repr

    calls = []

    class Loud:
        def __repr__(self):
            calls.append(1)
            return "loud"

    values = {
        "n": 3,
        "s": "a\nb",
        "t": torch.ones(2),
        "m": torch.nn.Linear(2, 2),
        "mix": [1, torch.zeros(1), {"k": Loud()}],
        "loud": Loud(),
        "long": list(range(1000)),
    }
    # WHEN each is read as the agent's thread reads locals
    shown = {k: safe_repr(v) for k, v in values.items()}
    # THEN built-ins are shown as repr shows them, every other object by its type only, and no
    # repr of the job's ran
    assert shown["n"] == "3" and shown["s"] == "'a\\nb'"
    assert shown["t"] == "<torch.Tensor>" and shown["m"] == "<torch.nn.modules.linear.Linear>"
    assert shown["mix"].startswith("[1, <torch.Tensor>, {'k': <")
    assert shown["loud"].endswith("Loud>") and calls == []
    assert shown["long"] == "[0, 1, 2, 3, 4, 5, 6, 7, …]"
