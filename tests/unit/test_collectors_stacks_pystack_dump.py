"""collectors/stacks/_pystack_dump.py: pystack's threads turned into a process dump's frames
(innermost first; C frames merged in at the interpreter's eval loops with --native, or kept
innermost when they cannot be matched), and its one-line failure. Built from pystack's own
types, without reading a process."""

from __future__ import annotations

import pytest

pystack_types = pytest.importorskip("pystack.types")

from collectors.stacks._pystack_dump import _frames, main  # noqa: E402

PyFrame, PyCodeObject, LocationInfo = pystack_types.PyFrame, pystack_types.PyCodeObject, pystack_types.LocationInfo
NativeFrame, PyThread = pystack_types.NativeFrame, pystack_types.PyThread
EVAL = "_PyEval_EvalFrameDefault"


def _py_frames(*specs: tuple[str, int, bool, bool]) -> PyFrame:
    """Python frames, outermost first: (function, line, is_entry, is_shim); returns the outermost."""
    first = prev = None
    for function, line, entry, shim in specs:
        frame = PyFrame(
            prev=prev,
            next=None,
            code=PyCodeObject("/job/train.py", function, LocationInfo(line, line, 0, 0)),
            arguments={"x": "1"} if function == "work" else {},
            locals={},
            is_entry=entry,
            is_shim=shim,
        )
        if prev is not None:
            prev.next = frame
        first = first or frame
        prev = frame
    return first


def _native(symbol: str) -> NativeFrame:
    return NativeFrame(0x1000, symbol, "/lib/x.c", 7, 0, "libx.so")


def _thread(native: list[NativeFrame]) -> PyThread:
    # as in CPython 3.12+: each eval loop starts at a shim frame, the entry frame of that loop
    frames = _py_frames(("<shim>", 0, True, True), ("main", 9, False, False), ("work", 40, False, False))
    return PyThread(
        tid=1, frame=frames, native_frames=native, holds_the_gil=1, is_gc_collecting=0, python_version=(3, 11)
    )


def test_python_frames_innermost_first_without_shims():
    frames = _frames(_thread([]), native=False)
    assert [(f["function"], f["line"], f["native"]) for f in frames] == [("work", 40, False), ("main", 9, False)]
    assert frames[0]["locals"] == {"x": "1"} and frames[1]["locals"] is None


def test_native_frames_are_merged_in_at_the_eval_loop():
    frames = _frames(_thread([_native("main_c"), _native(EVAL), _native("poll")]), native=True)
    assert [(f["function"], f["native"]) for f in frames] == [
        ("poll", True),
        ("work", False),
        ("main", False),
        ("main_c", True),
    ]
    assert frames[0]["library"] == "libx.so" and frames[0]["file"] == "/lib/x.c" and frames[0]["line"] == 7


def test_native_frames_that_do_not_match_stay_innermost():
    frames = _frames(_thread([_native(EVAL), _native(EVAL), _native("poll")]), native=True)
    assert [(f["function"], f["native"]) for f in frames] == [("poll", True), ("work", False), ("main", False)]


def test_native_frames_are_left_out_unless_asked():
    frames = _frames(_thread([_native(EVAL), _native("poll")]), native=False)
    assert all(not f["native"] for f in frames)


def test_a_core_file_that_cannot_be_read_is_exit_1_with_one_line(tmp_path, capsys):
    core = tmp_path / "core"
    core.write_bytes(b"not a core file")
    assert main(["--core", str(core), "--executable", "/bin/true"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
