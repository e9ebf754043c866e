"""collectors/stacks/render.py: one process's dump and the merged view as text, each line one
printable line whatever a frame, thread or host name holds."""

from __future__ import annotations

from collectors.stacks.merge import group_processes
from collectors.stacks.model import Frame, ProcessStacks, ThreadStack
from collectors.stacks.render import render_merged, render_process


def _process(pid: int, rank: int | None, frames: list[Frame], host: str | None = None, gil: bool = False):
    return ProcessStacks(
        pid=pid,
        method="py-spy",
        rank=rank,
        host=host,
        threads=[ThreadStack(tid=pid, name="MainThread", main=True, holds_gil=gil, frames=frames)],
    )


WAIT = [Frame("all_reduce", "/x/site-packages/torch/distributed/c10d.py", 10), Frame("main", "/job/t.py", 5)]
LOAD = [Frame("next_batch", "/job/data.py", 30), Frame("main", "/job/t.py", 5)]


def test_a_process_dump_names_the_process_its_method_and_every_thread_with_its_flags():
    # GIVEN a rank's dump with a note, a main thread holding the GIL and an idle thread without frames
    p = ProcessStacks(
        pid=42,
        method="pystack",
        native=True,
        rank=3,
        host="node-7",
        fallback_reason="py-spy was refused",
        notes=["core file"],
        threads=[
            ThreadStack(
                42, "MainThread", main=True, holds_gil=True, frames=[Frame("f", "/job/a.py", 2, locals={"x": "1"})]
            ),
            ThreadStack(43, "loader", active=False),
        ],
    )
    # WHEN rendered
    lines = render_process(p).splitlines()
    # THEN each part is said, in order, with the locals under their frame
    assert lines == [
        "rank 3 (pid 42 on node-7) read with pystack (native frames)",
        "  note: py-spy was refused",
        "  note: core file",
        'Thread 42 "MainThread" (main, holds the GIL)',
        "    f (/job/a.py:2)",
        "        x = 1",
        'Thread 43 "loader" (idle)',
        "    (no frames)",
    ]


def test_a_process_without_a_rank_is_named_by_pid():
    assert render_process(_process(9, None, [])).startswith("pid 9 read with py-spy")


def test_a_newline_or_escape_in_a_name_never_makes_a_line_of_its_own():
    # GIVEN a frame name and a host carrying a newline and an escape sequence
    forged = "f\nrank 0 (pid 1) read with agent\x1b[2J"
    p = _process(1, 0, [Frame(forged, "/job/t.py", 1)], host="evil\nhost")
    # WHEN rendered alone and merged
    one = render_process(p)
    merged = render_merged([p])
    # THEN no line starts with the forged text and no escape character is printed
    for text in (one, merged):
        assert not any(line.startswith("rank 0 (pid 1) read with agent") for line in text.splitlines())
        assert "\x1b" not in text
    assert len(one.splitlines()) == 3


def test_the_merged_view_lists_groups_marks_the_outlier_and_says_where_it_differs():
    # GIVEN three ranks waiting and one loading data, holding the GIL
    procs = [_process(r + 1, r, WAIT) for r in range(3)] + [_process(9, 3, LOAD, gil=True)]
    # WHEN merged and rendered
    text = render_merged(procs)
    # THEN the head counts processes and groups, the outlier is marked, and group 2 says where it departs
    lines = text.splitlines()
    assert lines[0].startswith("4 process(es), 2 group(s) by main-thread stack (read with py-spy;")
    assert "ranks 0-2: in all_reduce (torch/distributed/c10d.py:10) <- main (/job/t.py:5)" in lines
    assert "rank 3: in next_batch (/job/data.py:30)   <- outlier" in lines
    assert "== group 2: rank 3 (1 process) -- outlier" in lines
    assert "   main thread holds the GIL in: rank 3" in lines
    assert "   differs from group 1 at: next_batch (/job/data.py:30)" in lines
    assert "                group 1 is at: all_reduce (torch/distributed/c10d.py:10)" in lines
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_a_long_stack_is_cut_at_max_frames_with_the_rest_counted():
    frames = [Frame(f"f{i}", "/job/t.py", i) for i in range(10)]
    text = render_merged([_process(1, 0, frames)], max_frames=4)
    assert "    f3 (/job/t.py:3)" in text and "f4 (" not in text
    assert "    ... 6 more frames" in text


def test_a_group_without_frames_says_so_and_fallbacks_are_noted():
    p = _process(1, 0, [])
    p.fallback_reason = "ptrace refused"
    text = render_merged([p])
    assert "(no frames: the main thread was not found or runs no code)" in text
    assert text.splitlines()[-2:] == ["Notes:", "  rank 0: read with py-spy because ptrace refused"]


def test_processes_of_several_nodes_are_named_with_their_host():
    # GIVEN rank 0 on node-a holding the GIL and rank 1 on node-b, in one group
    procs = [_process(1, 0, WAIT, host="node-a", gil=True), _process(2, 1, WAIT, host="node-b")]
    # WHEN rendered with groups made by host, and with groups made without
    by_host = render_merged(procs, group_processes(procs, by_host=True))
    plain = render_merged(procs)
    # THEN only the first names the hosts, in the group's label and the GIL line
    assert "== group 1: rank 0 on node-a, rank 1 on node-b (2 processes)" in by_host
    assert "main thread holds the GIL in: rank 0 on node-a" in by_host
    assert "main thread holds the GIL in: rank 0\n" in plain
