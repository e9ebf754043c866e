"""collectors.memory.render: a memory summary as text (``dynprof show``, ``dynprof memory-report``)
and a snapshot as a self-contained HTML page that opens with no network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from collectors.memory import STACK_FILE, SUMMARY_FILE, render
from collectors.memory.render import (
    MAX_SEGMENTS_DRAWN,
    MAX_TIMELINE_POINTS,
    MAX_TRACE_LINES,
    format_summary,
    oom_sentence,
    render_artifact,
    render_html,
    segments_svg,
    timeline,
    timeline_svg,
)
from collectors.memory.summary import NO_STACK, summarize_snapshot
from dynprof.store import Artifact, ArtifactStore

MB = 1 << 20
GB = 1 << 30
DATA = Path(__file__).resolve().parent.parent / "data"
REAL = DATA / "memory_oom_artifact"
USER = {"filename": "/home/u/train.py", "line": 40, "name": "step"}
HOSTILE = {"filename": "/home/u/<b>x</b>.py", "line": 1, "name": "f\x1b[31m\nforged line"}


def seg(device: int, size: int, blocks: list[dict], address: int = 0x1000) -> dict:
    return {
        "device": device,
        "address": address,
        "total_size": size,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }


def blk(size: int, state: str, frames: list | None = None) -> dict:
    return {"address": 0, "size": size, "requested_size": size, "state": state, "frames": frames or []}


def snapshot(traces: list | None = None) -> dict:
    return {
        "segments": [
            seg(
                0,
                8 * MB,
                [blk(4 * MB, "active_allocated", [USER]), blk(2 * MB, "inactive"), blk(2 * MB, "active_pending_free")],
            ),
            seg(0, 2 * MB, [blk(2 * MB, "active_allocated")]),
        ],
        "device_traces": traces
        if traces is not None
        else [
            [
                {"action": "segment_alloc", "size": 8 * MB, "time_us": 1},
                {"action": "alloc", "size": 4 * MB, "time_us": 2, "frames": [USER]},
                {"action": "oom", "size": 64 * MB, "device_free": MB, "time_us": 3, "frames": [USER]},
            ]
        ],
    }


# -- the OOM's sentence ------------------------------------------------------------------------------
def test_the_oom_sentence_names_size_site_and_free_memory():
    failing = {
        "device": 1,
        "requested_bytes": 2 * MB,
        "site": "a.py:3 in f",
        "device_free_bytes": MB,
        "device_limit_bytes": 80 * GB,
    }
    assert oom_sentence(failing) == (
        "CUDA out of memory on cuda:1: tried to allocate 2.00 MiB at a.py:3 in f; 1.00 MiB free of 80.00 GiB"
    )


def test_the_oom_sentence_says_when_the_process_cap_not_the_device_refused():
    failing = {"device": 0, "requested_bytes": 2 * MB, "device_free_bytes": 10 * GB, "device_limit_bytes": 4 * GB}
    assert oom_sentence(failing) == (
        "CUDA out of memory on cuda:0: tried to allocate 2.00 MiB; the process is capped at 4.00 GiB "
        "(set_per_process_memory_fraction), 10.00 GiB free on the device"
    )


def test_the_oom_sentence_of_missing_figures_says_what_it_does_not_know():
    assert oom_sentence({}) == "CUDA out of memory on cuda:None: tried to allocate ?; ? free of ?"


# -- the text ----------------------------------------------------------------------------------------
def test_the_text_of_a_captured_oom():
    s = summarize_snapshot(snapshot())
    s.update(
        trigger="oom",
        memory_history="python:1000",
        torch_version="2.5.1",
        failing_allocation={
            "device": 0,
            "requested_bytes": 64 * MB,
            "device_free_bytes": MB,
            "device_limit_bytes": 80 * GB,
        },
        device_memory={"0": {"free_bytes": MB, "total_bytes": 80 * GB}},
        capture={"total_s": 0.25, "snapshot_s": 0.1, "pickle_s": 0.05, "pickle_bytes": 4096, "history_entries": 3},
        advice=[{"rule": "fragmentation", "reason": "the cache is crumbs", "advice": "set expandable_segments"}],
    )
    text = format_summary(s)
    lines = text.splitlines()
    assert lines[0] == "trigger: oom   memory history: python:1000   torch 2.5.1"
    assert lines[1].startswith("CUDA out of memory on cuda:0: tried to allocate 64.00 MiB; 1.00 MiB free of 80.00 GiB")
    # the recorded OOM is not repeated when the failing allocation is known
    assert "recorded OOM" not in text
    (row,) = [line for line in lines if line.startswith("cuda:0")]
    assert row.split() == [
        "cuda:0",
        "6.00",
        "MiB",
        "8.00",
        "MiB",
        "10.00",
        "MiB",
        "2.00",
        "MiB",
        "0.00",
        "1.00",
        "MiB",
        "80.00",
        "GiB",
        "2",
    ]
    assert "top allocation sites (live blocks, by bytes):" in lines
    assert "     4.00 MiB       1 blocks  /home/u/train.py:40 in step" in lines
    assert "largest live blocks:" in lines
    assert f"     2.00 MiB  cuda:0 0x0  {NO_STACK}" in lines
    assert "  [fragmentation] the cache is crumbs" in lines and "      -> set expandable_segments" in lines
    assert "history cuda:0: 3 events over 0.0 s (alloc 1, oom 1, segment_alloc 1)" in lines
    assert lines[-1] == "capture: 0.25 s (snapshot 0.1 s, pickle 0.05 s, 4.00 KiB, 3 history events)"


def test_a_snapshot_read_back_has_no_trigger_line_and_names_its_recorded_ooms():
    traces = [[{"action": "oom", "size": i * MB, "device_free": MB, "frames": [USER]} for i in range(1, 6)]]
    text = format_summary(summarize_snapshot(snapshot(traces)))
    assert not text.startswith("trigger:")
    ooms = [line for line in text.splitlines() if line.startswith("recorded OOM")]
    # the last three only
    assert ooms == [
        f"recorded OOM on cuda:0: tried to allocate {i}.00 MiB at /home/u/train.py:40 in step; 1.00 MiB free"
        for i in (3, 4, 5)
    ]
    # without the capture's device figures, the CUDA columns say '-'
    (row,) = [line for line in text.splitlines() if line.startswith("cuda:0")]
    assert row.split()[-3:] == ["-", "-", "2"]


def test_the_top_sites_say_why_they_have_no_stack_or_only_a_sampled_one():
    no_history = snapshot([])
    for s in no_history["segments"]:
        for b in s["blocks"]:
            b["frames"] = []
    s = summarize_snapshot(no_history)
    text = format_summary(s)
    assert "top allocation sites (live blocks, by bytes) — no stacks: memory history was off:" in text
    assert "history: none recorded (recording was off, or nothing was allocated since it started)" in text

    s = summarize_snapshot(snapshot())
    s["memory_history"] = "auto:python"
    text = format_summary(s)
    # with auto, the bytes that have a site among the top sites' are said
    assert "— sampled: `auto` records stacks in windows" in text and "(4.00 MiB of the top sites' bytes):" in text


def test_size_classes_are_listed_only_without_stacks_and_only_allocated_ones():
    classes = [
        {"device": 0, "pool": "large", "size_class": "1-2 MiB", "state": "allocated", "blocks": 3, "bytes": 5 * MB},
        {"device": 0, "pool": "small", "size_class": "<1 MiB", "state": "cached", "blocks": 9, "bytes": MB},
    ]
    s = summarize_snapshot(snapshot([]))
    s["stacks_recorded"] = False
    s["size_classes"] = classes
    text = format_summary(s)
    assert "blocks by pool and size class (no stacks recorded):" in text
    assert "  cuda:0 large 1-2 MiB              3 blocks    5.00 MiB" in text.splitlines()
    assert "<1 MiB" not in text
    s["stacks_recorded"] = True
    assert "blocks by pool and size class" not in format_summary(s)


def test_the_job_s_objects_and_the_failing_frames_tensors_are_named():
    s = summarize_snapshot(snapshot())
    s["attribution"] = {
        "optimizers": 1,
        "parameters_bytes": GB,
        "gradients_bytes": GB,
        "optimizer_state_bytes": 2 * GB,
        "frame_tensors_bytes": 3 * MB,
        "frame_tensors": [
            {
                "name": "acts (list of tensors)",
                "tensors": 3,
                "bytes": 2 * MB,
                "dtype": "float32",
                "shape": [4, 4],
                "frame": "step (t.py:3)",
            },
            {"name": "x", "tensors": 1, "bytes": MB, "dtype": "bfloat16", "shape": [2], "frame": "step (t.py:3)"},
        ]
        + [{"name": f"y{i}", "tensors": 1, "bytes": 1, "dtype": "int8", "shape": [1], "frame": "f"} for i in range(9)],
    }
    lines = format_summary(s).splitlines()
    assert (
        "held by the job's objects: parameters 1.00 GiB, gradients 1.00 GiB, optimizer state 2.00 GiB "
        "(1 optimizers); tensors in the failing frames 3.00 MiB"
    ) in lines
    assert "     2.00 MiB  acts (list of tensors) 3 tensors, e.g. float32[4, 4]  in step (t.py:3)" in lines
    assert "     1.00 MiB  x bfloat16[2]  in step (t.py:3)" in lines
    assert sum(1 for line in lines if line.startswith("          1 B  y")) == 3  # five tensors at most


def test_names_from_the_snapshot_cannot_forge_lines_or_send_escapes():
    s = summarize_snapshot({"segments": [seg(0, MB, [blk(MB, "active_allocated", [HOSTILE])])], "device_traces": []})
    text = format_summary(s)
    assert "\x1b" not in text and "\nforged line" not in text
    assert "\\x1b[31m\\nforged line" in text


def test_top_bounds_the_sites_and_blocks_listed():
    blocks = [
        blk(i * 1024, "active_allocated", [{"filename": f"/u/{i}.py", "line": 1, "name": "f"}]) for i in range(1, 9)
    ]
    s = summarize_snapshot({"segments": [seg(0, 64 * MB, blocks)], "device_traces": []})
    text = format_summary(s, top=2)
    assert "/u/8.py" in text and "/u/7.py" in text and "/u/6.py" not in text


# -- dynprof show ------------------------------------------------------------------------------------
def test_show_of_the_real_oom_artifact_ends_with_the_stack_that_hit_it():
    summary, text = render_artifact(Artifact.load(REAL))
    assert summary == json.loads((REAL / SUMMARY_FILE).read_text())
    assert text.startswith("trigger: oom   memory history: python:1000")
    _head, _, stack = text.partition("\n\nstack of the thread that hit the OOM (innermost last):\n")
    assert stack and stack.splitlines() == (REAL / STACK_FILE).read_text().rstrip().splitlines()[-12:]


def _artifact(tmp_path: Path, summary: dict, stack: str | None) -> Artifact:
    writer = ArtifactStore(tmp_path / "store").create("memory", job="j", host="h", rank=0)
    writer.write_json(SUMMARY_FILE, summary)
    if stack is not None:
        writer.write_text(STACK_FILE, stack)
    return writer.finish("complete")


def test_show_of_a_requested_snapshot_keeps_the_stack_s_last_twelve_lines(tmp_path):
    s = summarize_snapshot(snapshot())
    s["trigger"] = "request"
    stack = "".join(f"  line {i}\n" for i in range(30))
    _summary, text = render_artifact(_artifact(tmp_path, s, stack))
    head, _, tail = text.partition("\n\nstack of the thread that took it (innermost last):\n")
    assert tail.splitlines() == [f"  line {i}" for i in range(18, 30)]
    assert head == format_summary(s)


def test_show_without_a_stack_file_is_the_summary_alone(tmp_path):
    s = summarize_snapshot(snapshot())
    summary, text = render_artifact(_artifact(tmp_path, s, None))
    assert text == format_summary(summary) and "stack of the thread" not in text


# -- the timeline ------------------------------------------------------------------------------------
def test_the_timeline_ends_at_the_snapshot_s_levels_and_steps_back_through_the_events():
    events = [
        {"action": "segment_alloc", "size": 10},
        {"action": "alloc", "size": 4},
        {"action": "segment_map", "size": 5},
        {"action": "alloc", "size": 3},
        {"action": "free_completed", "size": 4},
        {"action": "free_requested", "size": 3},  # not a change of the active bytes yet
        {"action": "oom", "size": 100},
        {"action": "segment_unmap", "size": 5},
        {"action": "segment_free", "size": 2},
    ]
    tl = timeline({"device_traces": [events]}, 0, final_active=13, final_reserved=18)
    assert tl is not None
    assert tl["active"] == [10, 14, 14, 17, 13, 13, 13, 13, 13]
    assert tl["reserved"] == [20, 20, 25, 25, 25, 25, 25, 20, 18]
    assert tl["events"] == 9 and [i for i, _ in tl["ooms"]] == [6]


def test_a_device_without_events_has_no_timeline():
    assert timeline({"device_traces": [[], [{"action": "alloc", "size": 1}]]}, 0, 0, 0) is None
    assert timeline({"device_traces": [[]]}, 3, 0, 0) is None
    assert timeline({"segments": []}, 0, 0, 0) is None


def test_a_long_timeline_is_drawn_with_bucket_maxima():
    assert render._bucket_max([1, 2, 3], 5) == [1, 2, 3]
    assert render._bucket_max([1, 9, 2, 2, 7, 1], 3) == [9, 2, 7]
    tl = {"active": list(range(10_000)), "reserved": [10_000] * 10_000, "ooms": [], "events": 10_000}
    svg = timeline_svg(tl)
    active = re.search(r'stroke="#4e79a7"[^>]*points="([^"]*)"', svg)
    assert active is not None and len(active.group(1).split()) == MAX_TIMELINE_POINTS
    assert "event 10000" in svg and svg.startswith("<svg") and svg.endswith("</svg>")


def test_an_oom_on_the_timeline_is_a_line_whose_title_is_escaped():
    tl = timeline(
        {
            "device_traces": [
                [
                    {"action": "alloc", "size": 1},
                    {"action": "oom", "size": 2 * MB, "device_free": MB, "frames": [HOSTILE]},
                ]
            ]
        },
        0,
        1,
        1,
    )
    svg = timeline_svg(tl)
    assert 'stroke="#d62728"' in svg and "OOM: requested 2.00 MiB, 1.00 MiB free" in svg
    assert "<b>" not in svg and "&lt;b&gt;x&lt;/b&gt;" in svg


# -- the segments ------------------------------------------------------------------------------------
def test_segments_are_drawn_largest_first_with_their_live_blocks():
    svg, total = segments_svg(snapshot(), 0)
    assert total == 2
    assert svg.index("8.00 MiB") < svg.index(">2.00 MiB<")
    # live blocks only; one awaiting its stream is red
    assert svg.count('fill="#d62728"') == 1
    assert "4.00 MiB active_allocated\n/home/u/train.py:40 in step" in svg
    assert f"2.00 MiB active_allocated\n{NO_STACK}" in svg
    assert "inactive" not in svg


def test_a_device_without_segments_has_no_drawing_and_many_are_cut():
    assert segments_svg(snapshot(), 5) == ("", 0)
    many = {
        "segments": [seg(0, MB + i, [blk(MB, "active_allocated")]) for i in range(MAX_SEGMENTS_DRAWN + 7)],
        "device_traces": [],
    }
    svg, total = segments_svg(many, 0)
    assert total == MAX_SEGMENTS_DRAWN + 7
    assert svg.count("<title>segment ") == MAX_SEGMENTS_DRAWN


def test_a_segment_s_names_are_escaped():
    svg, _ = segments_svg({"segments": [seg(0, MB, [blk(MB, "active_allocated", [HOSTILE])])]}, 0)
    assert "<b>" not in svg and "&lt;b&gt;" in svg


# -- torch's own views ---------------------------------------------------------------------------------
def test_torch_s_text_views_are_embedded_cut_and_their_failures_said(monkeypatch):
    from torch.cuda import _memory_viz

    monkeypatch.setattr(_memory_viz, "segsum", lambda snap: "SEGSUM")
    monkeypatch.setattr(_memory_viz, "trace", lambda snap: "\n".join(f"t{i}" for i in range(MAX_TRACE_LINES + 10)))
    views = dict(render._torch_text_views({}))
    assert views["torch.cuda._memory_viz.segsum"] == "SEGSUM"
    trace = views["torch.cuda._memory_viz.trace"].splitlines()
    assert trace[0] == f"(last {MAX_TRACE_LINES} of {MAX_TRACE_LINES + 10} lines)"
    assert trace[1] == "t10" and len(trace) == MAX_TRACE_LINES + 1

    def broken(snap: dict) -> str:
        raise KeyError("frames")

    monkeypatch.setattr(_memory_viz, "segsum", broken)
    views = dict(render._torch_text_views({}))
    assert views["torch.cuda._memory_viz.segsum"] == (
        "(torch.cuda._memory_viz.segsum failed on this snapshot: KeyError: 'frames')"
    )


# -- the page --------------------------------------------------------------------------------------------
def _no_network(page: str) -> None:
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "@import" not in page and "url(http" not in page


def test_the_page_holds_every_view_and_loads_nothing():
    snap = snapshot()
    s = summarize_snapshot(snap)
    s.update(
        trigger="oom",
        memory_history="python:1000",
        torch_version="2.5.1",
        failing_allocation={"device": 0, "requested_bytes": 64 * MB, "site": "/home/u/train.py:40 in step"},
        capture={"total_s": 0.25, "snapshot_s": 0.1, "pickle_s": 0.05, "pickle_bytes": 4096, "history_entries": 3},
    )
    page = render_html(snap, s, "OOM <rank 0>", "/a/b&c", pickle_bytes=b"\x80\x04.")
    _no_network(page)
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</body></html>\n")
    assert "<title>OOM &lt;rank 0&gt;</title>" in page and "<code>/a/b&amp;c</code>" in page
    assert "trigger: oom" in page and "torch 2.5.1" in page
    assert '<div class="oom"><b>CUDA out of memory on cuda:0: tried to allocate 64.00 MiB;' in page
    assert "<br>at <code>/home/u/train.py:40 in step</code>" in page
    assert "memory history was off" not in page
    assert "cuda:0: memory over the last 3 allocator events" in page
    assert "cuda:0: segments and live blocks</h2>" in page
    assert "Top allocation sites" in page and "Largest live blocks" in page and "Recorded history" in page
    assert "captured in 0.25 s" in page
    assert 'href="data:application/octet-stream;base64,gAQu"' in page
    assert "torch.cuda._memory_viz.segsum" in page


def test_a_page_without_history_says_so_and_without_a_pickle_has_no_download():
    snap = snapshot([])
    for s in snap["segments"]:
        for b in s["blocks"]:
            b["frames"] = []
    page = render_html(snap, summarize_snapshot(snap), "t", "s")
    _no_network(page)
    assert "This snapshot has no allocation history and no stacks" in page
    assert "memory over the last" not in page and "Recorded history" not in page
    assert "download=" not in page and '<div class="oom"><b>' not in page


def test_a_page_of_many_segments_says_how_many_it_draws():
    snap = {
        "segments": [seg(0, MB, [blk(MB, "active_allocated")]) for _ in range(MAX_SEGMENTS_DRAWN + 1)],
        "device_traces": [],
    }
    page = render_html(snap, summarize_snapshot(snap), "t", "s")
    assert f"(the {MAX_SEGMENTS_DRAWN} largest of {MAX_SEGMENTS_DRAWN + 1})" in page


def test_hostile_names_are_escaped_everywhere_on_the_page():
    snap = {
        "segments": [seg(0, MB, [blk(MB, "active_allocated", [HOSTILE])])],
        "device_traces": [[{"action": "<i>", "size": 1, "frames": [HOSTILE]}]],
    }
    page = render_html(snap, summarize_snapshot(snap), "t", "s")
    assert "<b>x</b>" not in page and "<i>" not in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page


@pytest.mark.parametrize("artifact", ["memory_oom_artifact", "memory_leak_auto_artifact", "memory_leak_off_artifact"])
def test_the_pages_of_the_recorded_artifacts_open_offline(artifact):
    from collectors.memory.reader import load_snapshot, read_summary

    art = Artifact.load(DATA / artifact)
    page = render_html(load_snapshot(DATA / artifact / "snapshot.pickle"), read_summary(art), artifact, str(art.path))
    _no_network(page)
    assert "<h2>Devices</h2>" in page and page.count("<svg") >= 1
