"""collectors.memory.summary: a snapshot's figures, from its dicts and lists alone.

Each snapshot here is built in PyTorch's own shape (``segments`` of ``blocks``,
``device_traces`` of events), small enough to add up by hand.
"""

from __future__ import annotations

import json

import pytest

from collectors.memory.summary import (
    NO_STACK,
    SUMMARY_SCHEMA,
    SUMMARY_VERSION,
    allocation_site,
    format_frame,
    manifest_summary,
    summarize_snapshot,
)

MB = 1 << 20
TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
TORCH_SRC = {"filename": "torch/autograd/graph.py", "line": 7, "name": "_engine_run_backward"}
STDLIB = {"filename": "/usr/lib/python3.12/threading.py", "line": 1010, "name": "run"}
STDLIB_PKG = {"filename": "/usr/lib/python3.11/json/decoder.py", "line": 58, "name": "decode"}
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}
FROZEN = {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"}
USER = {"filename": "/home/u/train.py", "line": 40, "name": "step"}
LIB = {"filename": "/venv/lib/python3.12/site-packages/transformers/modeling.py", "line": 9, "name": "attn"}


def seg(device: int, size: int, blocks: list[dict], kind: str = "large", address: int = 0x1000) -> dict:
    return {
        "device": device,
        "address": address,
        "total_size": size,
        "stream": 0,
        "segment_type": kind,
        "blocks": blocks,
    }


def blk(size: int, state: str, frames: list | None = None, requested: int | None = None, address: int = 0) -> dict:
    out = {"address": address, "size": size, "state": state, "frames": frames or []}
    if requested is not None:
        out["requested_size"] = requested
    return out


# -- allocation sites --------------------------------------------------------------------------------
def test_the_site_is_the_innermost_frame_outside_torch_and_the_standard_library():
    assert allocation_site([CPP, TORCH, TORCH_SRC, STDLIB, STDLIB_PKG, FROZEN, USER, LIB]) == (
        "/home/u/train.py:40 in step"
    )


def test_a_library_other_than_torch_in_site_packages_is_a_site():
    # site-packages under the standard library's folder is not the standard library
    assert allocation_site([TORCH, LIB, USER]) == f"{LIB['filename']}:9 in attn"
    for single in ("/venv/lib/python3.12/site-packages/six.py", "/usr/lib/python3.11/dist-packages/six.py"):
        assert allocation_site([TORCH, {"filename": single, "line": 3, "name": "f"}]) == f"{single}:3 in f"


def test_without_a_site_frame_the_first_python_frame_then_the_first_frame_stands_in():
    assert allocation_site([CPP, TORCH, STDLIB]) == format_frame(TORCH)
    assert allocation_site([CPP, FROZEN]) == format_frame(CPP)
    assert allocation_site([]) is None
    assert allocation_site(None) is None


def test_a_frame_missing_its_fields_is_formatted_with_question_marks():
    assert format_frame({}) == "?:? in ?"
    assert format_frame({"filename": "a.py", "line": 3}) == "a.py:3 in ?"


# -- per-device figures -------------------------------------------------------------------------------
def test_every_block_state_lands_in_its_figure():
    snapshot = {
        "segments": [
            seg(
                0,
                16 * MB,
                [
                    blk(4 * MB, "active_allocated", [USER], requested=4 * MB - 10),
                    blk(2 * MB, "active_pending_free", [USER]),
                    blk(1 * MB, "active_awaiting_free"),
                    blk(3 * MB, "inactive"),
                    blk(6 * MB, "inactive"),
                ],
            ),
            seg(0, 2 * MB, [blk(2 * MB, "active_allocated")], kind="small"),
        ],
        "device_traces": [],
    }
    (d,) = summarize_snapshot(snapshot)["devices"]
    assert (d["segments"], d["large_segments"], d["small_segments"], d["blocks"]) == (2, 1, 1, 6)
    assert d["reserved_bytes"] == 18 * MB
    assert d["allocated_bytes"] == 6 * MB
    # requested_size where the allocator recorded it, else the block's size
    assert d["requested_bytes"] == 6 * MB - 10
    assert d["pending_free_bytes"] == 3 * MB
    assert d["active_bytes"] == 9 * MB
    assert d["inactive_bytes"] == 9 * MB and d["largest_inactive_block"] == 6 * MB
    assert d["fragmentation"] == pytest.approx(1 - 6 / 9, abs=1e-4)
    assert d["cached_free_fraction"] == pytest.approx(9 / 18, abs=1e-4)


def test_a_device_without_cached_free_memory_has_no_fragmentation():
    snapshot = {
        "segments": [seg(1, 4 * MB, [blk(4 * MB, "active_allocated")])],
        "device_traces": [[{"action": "alloc", "size": 1, "time_us": 5}], []],
    }
    s = summarize_snapshot(snapshot)
    d0, d1 = s["devices"]
    # device 0 has history only: it appears, all zero
    assert d0["device"] == 0 and d0["segments"] == 0 and d0["reserved_bytes"] == 0
    assert d1["fragmentation"] == 0.0 and d1["cached_free_fraction"] == 0.0
    assert [d["device"] for d in s["devices"]] == [0, 1]


def test_a_device_seen_in_the_history_only_has_every_figure():
    # After torch.cuda.empty_cache() a device can have recorded history and no segment left.
    s = summarize_snapshot({"segments": [], "device_traces": [[{"action": "alloc", "size": 1, "time_us": 5}]]})
    (d,) = s["devices"]
    assert d["fragmentation"] == 0.0 and d["cached_free_fraction"] == 0.0


def test_missing_or_null_fields_count_as_zero_and_blocks_that_are_not_a_list_as_none():
    snapshot = {
        "segments": [
            {"device": None, "total_size": None, "blocks": "not a list"},
            {"total_size": 2 * MB, "blocks": [{"state": "active_allocated", "size": None}]},
        ],
        "device_traces": [],
    }
    s = summarize_snapshot(snapshot)
    (d,) = s["devices"]
    assert d["device"] == 0 and d["segments"] == 2 and d["blocks"] == 1
    assert d["reserved_bytes"] == 2 * MB and d["allocated_bytes"] == 0
    # a segment without a segment_type is a large one
    assert d["large_segments"] == 2


def test_the_totals_add_up_the_devices():
    snapshot = {
        "segments": [
            seg(0, 8 * MB, [blk(8 * MB, "active_allocated")]),
            seg(3, 4 * MB, [blk(1 * MB, "active_allocated"), blk(3 * MB, "inactive")]),
        ],
        "device_traces": [],
    }
    totals = summarize_snapshot(snapshot)["totals"]
    assert totals == {
        "reserved_bytes": 12 * MB,
        "allocated_bytes": 9 * MB,
        "active_bytes": 9 * MB,
        "inactive_bytes": 3 * MB,
        "segments": 2,
        "blocks": 3,
    }


def test_an_empty_snapshot_has_an_empty_summary_that_is_json():
    s = summarize_snapshot({"segments": [], "device_traces": []})
    assert s["schema"] == SUMMARY_SCHEMA and s["schema_version"] == SUMMARY_VERSION
    assert s["devices"] == [] and s["top_sites"] == [] and s["largest_blocks"] == [] and s["history"] == []
    assert s["totals"]["reserved_bytes"] == 0
    assert not s["history_recorded"] and not s["stacks_recorded"]
    assert s["allocator_settings"] is None
    json.dumps(s)  # what summary.json holds: nothing that is not JSON (no sets)


# -- sites and blocks ---------------------------------------------------------------------------------
def test_live_blocks_are_grouped_by_site_over_devices_and_ranked_by_bytes():
    other = {"filename": "/home/u/model.py", "line": 10, "name": "forward"}
    snapshot = {
        "segments": [
            seg(0, 16 * MB, [blk(3 * MB, "active_allocated", [TORCH, USER]), blk(1 * MB, "inactive", [other])]),
            seg(1, 16 * MB, [blk(5 * MB, "active_allocated", [other]), blk(2 * MB, "active_allocated", [USER])]),
            seg(1, 2 * MB, [blk(MB, "active_pending_free", [other]), blk(MB, "active_allocated")], kind="small"),
        ],
        "device_traces": [],
        "allocator_settings": {"expandable_segments": True},
    }
    s = summarize_snapshot(snapshot)
    sites = [(x["site"], x["bytes"], x["blocks"], x["devices"]) for x in s["top_sites"]]
    assert sites == [
        ("/home/u/model.py:10 in forward", 6 * MB, 2, [1]),  # the inactive block is not live
        ("/home/u/train.py:40 in step", 5 * MB, 2, [0, 1]),
        (NO_STACK, MB, 1, [1]),
    ]
    assert s["top_sites"][1]["stack"] == [format_frame(TORCH), format_frame(USER)]
    assert [b["size"] for b in s["largest_blocks"]] == [5 * MB, 3 * MB, 2 * MB, MB, MB]
    assert s["allocator_settings"] == {"expandable_segments": True}
    assert s["stacks_recorded"] and s["history_recorded"]  # stacks on live blocks say history was on


def test_top_bounds_the_sites_and_the_largest_blocks():
    blocks = [
        blk(i * 1024, "active_allocated", [{"filename": f"/a{i}.py", "line": i, "name": "f"}]) for i in range(1, 30)
    ]
    s = summarize_snapshot({"segments": [seg(0, 64 * MB, blocks)], "device_traces": []}, top=3)
    assert [x["bytes"] for x in s["top_sites"]] == [29 * 1024, 28 * 1024, 27 * 1024]
    assert [x["size"] for x in s["largest_blocks"]] == [29 * 1024, 28 * 1024, 27 * 1024]


def test_a_largest_block_says_its_device_address_request_state_and_site():
    s = summarize_snapshot(
        {
            "segments": [seg(2, 4 * MB, [blk(4 * MB, "active_allocated", [USER], requested=3 * MB, address=255)])],
            "device_traces": [],
        }
    )
    assert s["largest_blocks"] == [
        {
            "device": 2,
            "address": "0xff",
            "size": 4 * MB,
            "requested_size": 3 * MB,
            "state": "active_allocated",
            "site": "/home/u/train.py:40 in step",
            "stack": ["/home/u/train.py:40 in step"],
        }
    ]


def test_a_short_stack_keeps_python_frames_only_and_at_most_eight():
    many = [CPP] + [{"filename": f"/u/f{i}.py", "line": i, "name": "g"} for i in range(12)]
    s = summarize_snapshot({"segments": [seg(0, MB, [blk(MB, "active_allocated", many)])], "device_traces": []})
    stack = s["largest_blocks"][0]["stack"]
    assert len(stack) == 8 and stack[0] == "/u/f0.py:0 in g" and all(".py:" in line for line in stack)
    # only C++ frames: they are kept, as they are all there is
    s = summarize_snapshot({"segments": [seg(0, MB, [blk(MB, "active_allocated", [CPP])])], "device_traces": []})
    assert s["largest_blocks"][0]["stack"] == [format_frame(CPP)]


# -- history --------------------------------------------------------------------------------------------
def test_history_counts_actions_span_and_recorded_ooms_per_device():
    traces = [
        [],
        [
            {"action": "segment_alloc", "size": 20 * MB, "time_us": 1_000_000, "frames": [USER]},
            {"action": "alloc", "size": 8 * MB, "time_us": 1_500_000, "frames": [USER]},
            {"action": "alloc", "size": 8 * MB, "time_us": 0},  # a zero time is no time
            {"action": "oom", "size": 64 * MB, "device_free": 3 * MB, "time_us": 3_250_000, "frames": [TORCH, USER]},
            {"action": "oom", "size": 32 * MB, "addr": 2 * MB},  # older torch: the free bytes in addr
        ],
    ]
    s = summarize_snapshot({"segments": [], "device_traces": traces})
    (h,) = s["history"]
    assert h == {
        "device": 1,
        "entries": 5,
        "actions": {"segment_alloc": 1, "alloc": 2, "oom": 2},
        "span_s": 2.25,
    }
    assert s["oom_events"] == [
        {
            "device": 1,
            "requested_bytes": 64 * MB,
            "device_free_bytes": 3 * MB,
            "site": "/home/u/train.py:40 in step",
            "stack": [format_frame(TORCH), format_frame(USER)],
        },
        {"device": 1, "requested_bytes": 32 * MB, "device_free_bytes": 2 * MB, "site": None, "stack": []},
    ]
    assert s["history_recorded"] and s["stacks_recorded"]
    assert [d["device"] for d in s["devices"]] == [1]


def test_a_history_of_one_timed_event_has_no_span_and_without_frames_no_stacks():
    s = summarize_snapshot({"segments": [], "device_traces": [[{"action": "alloc", "size": 1, "time_us": 9}]]})
    assert s["history"][0]["span_s"] is None
    assert s["history_recorded"] and not s["stacks_recorded"]


def test_without_traces_there_is_no_history():
    s = summarize_snapshot({"segments": [seg(0, MB, [blk(MB, "active_allocated")])]})
    assert s["history"] == [] and s["oom_events"] == [] and not s["history_recorded"]


# -- the manifest's few fields ------------------------------------------------------------------------
def test_the_manifest_summary_of_a_full_summary():
    s = summarize_snapshot(
        {"segments": [seg(0, 8 * MB, [blk(6 * MB, "active_allocated", [USER])])], "device_traces": []}
    )
    s.update(
        trigger="oom",
        memory_history="python:1000",
        failing_allocation={"device": 0, "requested_bytes": 2 * MB},
        capture={"total_s": 0.5, "pickle_bytes": 1234},
        advice=[{"rule": "fragmentation"}, "not a dict", {"rule": "activations"}],
    )
    assert manifest_summary(s) == {
        "trigger": "oom",
        "memory_history": "python:1000",
        "allocated_bytes": 6 * MB,
        "reserved_bytes": 8 * MB,
        "failing_device": 0,
        "failing_bytes": 2 * MB,
        "top_site": "/home/u/train.py:40 in step",
        "top_site_bytes": 6 * MB,
        "capture_s": 0.5,
        "pickle_bytes": 1234,
        "advice": ["fragmentation", "activations"],
    }


def test_the_manifest_summary_of_a_bare_summary_has_nones():
    m = manifest_summary(summarize_snapshot({"segments": [], "device_traces": []}))
    assert m["top_site"] is None and m["top_site_bytes"] is None
    assert m["failing_device"] is None and m["failing_bytes"] is None
    assert m["capture_s"] is None and m["pickle_bytes"] is None and m["advice"] == []
    assert m["allocated_bytes"] == 0 and m["trigger"] is None
