"""collectors/stacks/model.py: frames, threads and process dumps, the stacks document and its
bounded decoders, and the names (paths, symbols, headlines, rank labels) a person reads."""

from __future__ import annotations

import io
import json
import os

import pytest

from collectors.stacks import model
from collectors.stacks.model import (
    MAX_FRAMES,
    MAX_TEXT,
    Budget,
    Frame,
    Group,
    ProcessStacks,
    Stacks,
    ThreadStack,
    from_json,
    headline,
    is_library_path,
    process_row,
    rank_labels,
    rank_runs,
    read_document,
    short_path,
    short_symbol,
    sort_key,
)
from dynprof.errors import ArtifactError

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _process(pid: int = 100, rank: int | None = 0, host: str | None = None, frames=None) -> ProcessStacks:
    frames = frames if frames is not None else [Frame("all_reduce", C10D, 2806), Frame("main", "/job/train.py", 9)]
    return ProcessStacks(
        pid=pid,
        method="py-spy",
        rank=rank,
        host=host,
        threads=[
            ThreadStack(tid=pid + 1, name="loader", frames=[Frame("wait", "/job/data.py", 3)]),
            ThreadStack(tid=pid, name="MainThread", main=True, holds_gil=True, frames=frames),
        ],
        notes=["a note"],
    )


def test_native_frames_are_keyed_by_symbol_and_library_name_not_by_address_or_line():
    # GIVEN the same C function seen through two paths to one library, at different lines
    a = Frame("ncclWait", "/a/lib/libnccl.so.2", 10, native=True, library="/a/lib/libnccl.so.2")
    b = Frame("ncclWait", "/b/lib/libnccl.so.2", 99, native=True, library="/b/lib/libnccl.so.2")
    # WHEN their keys are compared
    # THEN they are one frame; Python frames still differ by line
    assert a.key() == b.key() == ("ncclWait", "libnccl.so.2", 0)
    assert Frame("f", "/x.py", 1).key() != Frame("f", "/x.py", 2).key()


def test_where_names_a_python_frame_by_short_path_and_a_native_one_by_library():
    # GIVEN a library Python frame and a native frame
    py = Frame("all_reduce", C10D, 2806)
    native = Frame("cudaDeviceSynchronize", "/usr/lib/libcudart.so.12", native=True, library="/usr/lib/libcudart.so.12")
    # WHEN each says where it is
    # THEN the site-packages prefix is gone and the library is named by its file
    assert py.where() == "all_reduce (torch/distributed/distributed_c10d.py:2806)"
    assert native.where() == "cudaDeviceSynchronize [libcudart.so.12]"


def test_a_frames_locals_travel_only_when_asked_for():
    # GIVEN a frame with a local
    f = Frame("step", "/job/train.py", 5, locals={"i": "3"})
    # WHEN written without and with locals
    # THEN only the second carries them
    assert "locals" not in f.to_json()
    assert f.to_json(with_locals=True)["locals"] == {"i": "3"}


def test_a_process_dump_reads_back_as_the_same_process():
    # GIVEN a process dump with two threads, locals and a note
    p = _process(host="node-1")
    p.threads[1].frames[0].locals = {"tensor": "tensor([1.])"}
    # WHEN written and read back (through JSON text, as from a file)
    back = ProcessStacks.from_json(json.loads(json.dumps(p.to_json())))
    # THEN every field that was written is there again
    assert back == p


@pytest.mark.parametrize(
    "doc, message",
    [
        ([], "not a JSON object"),
        ({"schema": "dynprof.stacks", "schema_version": 2, "pid": 1}, "not a dynprof stack dump of this version"),
        ({"schema": "dynprof.stacks.process", "schema_version": 1, "pid": 1}, "version 1"),
        ({"pid": 1}, "no schema"),
        ({"schema": "dynprof.stacks.process", "schema_version": 2}, "without a pid"),
        ({"schema": "dynprof.stacks.process", "schema_version": 2, "pid": True}, "without a pid"),
        ({"schema": "dynprof.stacks.process", "schema_version": 2, "pid": 1 << 70}, "without a pid"),
    ],
)
def test_what_is_not_a_process_dump_of_this_version_is_refused_with_the_reason(doc, message):
    # GIVEN a document that is not a current process dump
    # WHEN it is decoded
    # THEN an ArtifactError says why
    with pytest.raises(ArtifactError, match=message):
        ProcessStacks.from_json(doc)


def test_fields_of_the_wrong_type_in_a_process_dump_are_dropped_not_raised():
    # GIVEN a dump whose fields hold the wrong types
    doc = {
        "schema": "dynprof.stacks.process",
        "schema_version": 2,
        "pid": 7,
        "method": 5,
        "native": "yes",
        "rank": "0",
        "host": ["node"],
        "threads": [1, "x", {"tid": "9", "frames": [None, {"function": "f", "line": "3"}]}],
        "captured_at": float("nan"),
        "duration_s": True,
        "notes": [None, "", "kept"],
    }
    # WHEN it is decoded
    p = ProcessStacks.from_json(doc)
    # THEN each bad field has its empty value and the good ones are kept
    assert (p.pid, p.method, p.native, p.rank, p.host) == (7, "?", False, None, None)
    assert len(p.threads) == 1 and p.threads[0].tid == 0
    assert p.threads[0].frames == [Frame("f", "", 0)]
    assert (p.captured_at, p.duration_s) == (0.0, 0.0)
    assert p.notes == ["kept"]


def test_long_strings_and_stacks_are_cut_to_their_bounds_and_counted():
    # GIVEN a dump with a name over the text bound and a stack over the frame bound
    doc = _process().to_json()
    doc["host"] = "h" * (MAX_TEXT + 10)
    doc["threads"][1]["frames"] = [{"function": f"f{i}", "file": "/x.py", "line": i} for i in range(MAX_FRAMES + 5)]
    budget = Budget()
    # WHEN it is decoded
    p = ProcessStacks.from_json(doc, budget)
    # THEN both are cut, the innermost frames kept, and each cut counted
    assert p.host == "h" * MAX_TEXT
    frames = p.threads[1].frames
    assert len(frames) == MAX_FRAMES and frames[0].function == "f0"
    assert budget.truncated == 1 + 5


def test_identical_frames_are_kept_once_in_a_read():
    # GIVEN two threads with the same frame and no locals
    budget = Budget()
    # WHEN both are read with one budget
    a = budget.thread({"tid": 1, "frames": [{"function": "f", "file": "/x.py", "line": 1}]})
    b = budget.thread({"tid": 2, "frames": [{"function": "f", "file": "/x.py", "line": 1}]})
    # THEN they share the one Frame object and it was counted once
    assert a is not None and b is not None
    assert a.frames[0] is b.frames[0]
    assert budget.frames_kept == 1


def test_a_read_past_its_text_budget_is_refused(monkeypatch):
    # GIVEN a budget of 10 characters in all
    monkeypatch.setattr(model, "MAX_TEXT_TOTAL", 10)
    budget = Budget()
    budget.text("abcdef")
    # WHEN repeated text is read, it costs nothing; new text past the budget is refused
    assert budget.text("abcdef") == "abcdef"
    with pytest.raises(ArtifactError, match="characters of text: refused"):
        budget.text("ghijkl")


def test_the_main_thread_is_the_one_marked_else_the_one_whose_tid_is_the_pid_else_the_first():
    # GIVEN processes with and without a marked main thread
    marked = ProcessStacks(1, "agent", threads=[ThreadStack(1), ThreadStack(2, main=True)])
    by_tid = ProcessStacks(5, "agent", threads=[ThreadStack(6), ThreadStack(5)])
    neither = ProcessStacks(9, "agent", threads=[ThreadStack(11), ThreadStack(12)])
    # WHEN each is asked for its main thread
    # THEN the rule above holds, and a process without threads has none
    assert marked.main_thread() is marked.threads[1]
    assert by_tid.main_thread() is by_tid.threads[1]
    assert neither.main_thread() is neither.threads[0]
    assert ProcessStacks(3, "agent").main_thread() is None


def test_a_process_is_labelled_by_rank_where_known_else_by_pid():
    assert _process(pid=10, rank=3).label == "rank 3"
    assert _process(pid=10, rank=None).label == "pid 10"


def test_a_stacks_document_reads_back_with_each_process_and_its_main_thread():
    # GIVEN a merged view of two processes and a failure
    stacks = Stacks([_process(100, 0, "node-1"), _process(200, 1, "node-2")], failures={"rank 2": "gone"})
    # WHEN written as a document and decoded
    doc = json.loads(json.dumps(stacks.to_json()))
    back = from_json(doc)
    # THEN the document names its hosts, and the decoder gives the processes with main threads only
    assert doc["hosts"] == ["node-1", "node-2"]
    assert [(p.pid, p.rank, p.host) for p in back.processes] == [(100, 0, "node-1"), (200, 1, "node-2")]
    assert [len(p.threads) for p in back.processes] == [1, 1]
    main = back.processes[0].threads[0]
    assert main.main and main.tid == 100 and main.frames == stacks.processes[0].threads[1].frames
    assert back.failures == {"rank 2": "gone"}


def test_a_document_counts_the_main_thread_frames_it_leaves_out():
    # GIVEN a process whose main stack is 3 frames over the bound
    deep = [Frame(f"f{i}", "/x.py", i) for i in range(MAX_FRAMES + 3)]
    stacks = Stacks([_process(frames=deep)], truncated=2)
    # WHEN written as a document
    doc = stacks.to_json()
    # THEN its row holds the bound and `truncated` adds the 3 cut to those already counted
    assert len(doc["processes"][0]["main_thread"]["frames"]) == MAX_FRAMES
    assert doc["truncated"] == 5


def test_a_process_row_names_its_file_only_when_it_has_one():
    p = _process()
    assert "file" not in process_row(p)
    p.file = "rank0-pid100"
    assert process_row(p)["file"] == "rank0-pid100"


@pytest.mark.parametrize(
    "doc, message",
    [
        ("text", "not a JSON object"),
        ({"schema": "dynprof.stacks.process", "schema_version": 2, "processes": []}, "stacks document"),
        ({"schema": "dynprof.stacks", "schema_version": 2, "processes": {}}, "no list of processes"),
        ({"processes": []}, "no schema"),
    ],
)
def test_what_is_not_a_stacks_document_is_refused_with_the_reason(doc, message):
    with pytest.raises(ArtifactError, match=message):
        from_json(doc)


def test_rows_without_a_pid_are_left_out_of_a_document():
    # GIVEN a document with one good row and rows without a usable pid
    doc = {"schema": "dynprof.stacks", "schema_version": 2, "processes": [{"pid": 4}, {"pid": "4"}, {}, 3]}
    # WHEN decoded
    # THEN only the good row is a process
    assert [p.pid for p in from_json(doc).processes] == [4]


def test_a_document_file_reads_like_the_parsed_document():
    # GIVEN a stacks document as the bytes of a file
    stacks = Stacks([_process(100, 0), _process(200, 1)])
    data = json.dumps(stacks.to_json()).encode()
    # WHEN read from the file
    back = read_document(io.BytesIO(data))
    # THEN it is what from_json gives for the parsed document
    assert back == from_json(json.loads(data))


def test_a_document_file_nested_too_deep_is_refused_before_it_is_decoded():
    # GIVEN a small file nesting far deeper than a stacks document can
    data = b'{"schema": "dynprof.stacks", "x": ' + b"[" * 40 + b"]" * 40 + b"}"
    # WHEN read
    # THEN it is refused for its depth
    with pytest.raises(ArtifactError, match="nested deeper than"):
        read_document(io.BytesIO(data))


def test_short_path_drops_site_packages_and_the_standard_librarys_prefix():
    assert short_path(C10D) == "torch/distributed/distributed_c10d.py"
    assert short_path("/usr/lib/python3.11/threading.py") == "threading.py"
    assert short_path(os.path.join(os.getcwd(), "job", "t.py")) == os.path.join("job", "t.py")
    assert short_path("/elsewhere/t.py") in ("/elsewhere/t.py", os.path.relpath("/elsewhere/t.py"))
    assert not short_path("/elsewhere/t.py").startswith(".."), "a path outside the cwd is not made relative"


def test_short_symbol_collapses_template_and_parameter_lists_of_long_symbols_only():
    # GIVEN a short symbol and a long templated one
    short = "c10d::ProcessGroupNCCL::wait(int)"
    long = "c10d::Work<" + "std::vector<at::Tensor>, " * 10 + ">::wait(std::chrono::milliseconds)"
    # WHEN shortened
    # THEN the short one is unchanged; the long one keeps its names with `<...>` and `(...)`
    assert short_symbol(short) == short
    assert short_symbol(long) == "c10d::Work<...>::wait(...)"
    assert len(short_symbol("x" * 500)) == 100 and short_symbol("x" * 500).endswith("...")


@pytest.mark.parametrize(
    "path, library",
    [
        (C10D, True),
        ("/usr/lib/python3/dist-packages/numpy/core.py", True),
        ("/usr/lib/python3.12/threading.py", True),
        ("<frozen importlib._bootstrap>", True),
        ("/job/train.py", False),
    ],
)
def test_library_paths_are_site_packages_dist_packages_the_standard_library_and_frozen_modules(path, library):
    assert is_library_path(path) is library


def test_the_headline_names_the_innermost_python_frame_the_users_own_frame_and_what_native_code_waits_in():
    # GIVEN native frames (libc's, then NCCL's wait) under a library frame called from the user's code
    frames = [
        Frame("__futex_wait", "/lib/libc.so.6", native=True, library="/lib/libc.so.6"),
        Frame("ncclGroupEnd", "/x/libnccl.so.2", native=True, library="/x/libnccl.so.2"),
        Frame("all_reduce", C10D, 2806),
        Frame("main", "/job/train.py", 40),
    ]
    # WHEN the headline is made
    text = headline(frames)
    # THEN it reads innermost Python <- user frame [native: the non-system wait]
    assert text == (
        "in all_reduce (torch/distributed/distributed_c10d.py:2806) <- main (/job/train.py:40) [native: ncclGroupEnd]"
    )


def test_the_headline_of_no_frames_or_only_native_ones():
    native = Frame("epoll_wait", "/lib/libc.so.6", native=True, library="/lib/libc.so.6")
    assert headline([]) == "no frames"
    assert headline([native]) == "in epoll_wait [libc.so.6]"


def test_rank_labels_collapse_runs_of_ranks_and_list_pids_where_ranks_are_unknown():
    procs = [_process(pid=10 + r, rank=r) for r in (5, 0, 1, 2, 7, 6)]
    assert rank_labels(procs) == "ranks 0-2,5-7"
    assert rank_labels(procs[:1]) == "rank 5"
    assert rank_labels([_process(pid=30, rank=None), _process(pid=20, rank=None)]) == "pids 20,30"
    assert rank_labels([_process(rank=1), _process(pid=20, rank=None)]) == "rank 1 + pid 20"
    assert rank_labels([]) == "no processes"


def test_rank_runs_join_consecutive_ranks_into_runs():
    assert rank_runs([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert rank_runs([4]) == "4"
    assert rank_runs([]) == ""


def test_rank_labels_by_host_name_each_node_and_count_them_past_a_few():
    # GIVEN ranks 0-1 on node-a and 2-3 on node-b, and then ranks spread over 5 nodes
    two = [_process(pid=r + 1, rank=r, host="node-b" if r >= 2 else "node-a") for r in (3, 2, 1, 0)]
    five = [_process(pid=r + 1, rank=r, host=f"node-{r}") for r in range(5)]
    # WHEN labelled by host
    # THEN nodes are named in rank order, and five nodes are counted instead
    assert rank_labels(two, by_host=True) == "ranks 0-1 on node-a, ranks 2-3 on node-b"
    assert rank_labels(five, by_host=True) == "ranks 0-4 on 5 nodes"


def test_processes_sort_by_rank_then_pid_with_unranked_ones_last():
    procs = [_process(pid=5, rank=None), _process(pid=9, rank=1), _process(pid=2, rank=None), _process(pid=3, rank=0)]
    assert [p.pid for p in sorted(procs, key=sort_key)] == [3, 9, 2, 5]


def test_a_groups_json_names_its_odd_members_only_when_it_is_an_outlier():
    # GIVEN a group of two processes on one host
    members = [_process(pid=1, rank=0, host="n"), _process(pid=2, rank=1, host="n")]
    group = Group(members, members[0].threads[1].frames, by_host=True)
    # WHEN written, first as an ordinary group and then as an outlier
    plain = group.to_json()
    group.outlier = True
    odd = group.to_json()
    # THEN sizes and labels are the members', and only the outlier lists its members by name
    assert (plain["size"], plain["ranks"], plain["label"]) == (2, [0, 1], "ranks 0-1 on n")
    assert plain["odd"] == [] and odd["odd"] == ["rank 0 on n", "rank 1 on n"]
