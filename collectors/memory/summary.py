"""A memory snapshot's figures: per-device totals, fragmentation, the largest live blocks, the
top allocation sites and the event history's shape, computed from the snapshot alone.

Pure functions on the snapshot's dicts and lists: no torch, no file access. The capture runs
them in the training process to write ``summary.json``; ``dynprof show`` and ``dynprof
memory-report`` run them on a snapshot read back (see :mod:`collectors.memory.reader`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

SUMMARY_SCHEMA = "dynprof.memory.summary"
SUMMARY_VERSION = 1

# Live blocks without a Python stack: allocated before recording started, with history off, or
# by threads that run no Python (the autograd engine's backward threads, C++ extensions).
NO_STACK = "(no Python stack recorded)"

ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")

# Frames inside PyTorch itself, the standard library or the interpreter never name an allocation
# site: the site is the first frame, from the innermost out, that is the user's (or a library's
# other than torch). Matched against the frame's filename.
_TORCH_FILE = re.compile(r"(^|/)torch/.+\.py$")
_STDLIB_FILE = re.compile(r"/lib/python3\.\d+/(?!site-packages/|dist-packages/)[^/]+(/[^/]+)?\.py$")


def _is_site_frame(frame: dict[str, Any]) -> bool:
    filename = str(frame.get("filename", ""))
    if not filename.endswith(".py"):  # C++ frames, <frozen ...>, <string>, ??
        return False
    return not (_TORCH_FILE.search(filename) or _STDLIB_FILE.search(filename))


def format_frame(frame: dict[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def allocation_site(frames: list[dict[str, Any]] | None) -> str | None:
    """The innermost frame outside torch and the standard library, as ``file:line in func``."""
    if not frames:
        return None
    for frame in frames:
        if _is_site_frame(frame):
            return format_frame(frame)
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return format_frame(python[0] if python else frames[0])


def _short_stack(frames: list[dict[str, Any]] | None, limit: int = 8) -> list[str]:
    if not frames:
        return []
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")] or frames
    return [format_frame(f) for f in python[:limit]]


def _blocks(segment: dict[str, Any]) -> list[dict[str, Any]]:
    blocks = segment.get("blocks")
    return blocks if isinstance(blocks, list) else []


def summarize_snapshot(snapshot: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Per-device totals, fragmentation, largest live blocks, top allocation sites and the
    event history's shape, computed from the snapshot alone (no torch needed)."""
    devices: dict[int, dict[str, Any]] = {}
    live: list[tuple[int, int, dict[str, Any]]] = []  # (size, device, block)
    sites: dict[str, dict[str, Any]] = {}
    blocks_with_frames = 0

    def dev(index: int) -> dict[str, Any]:
        if index not in devices:
            devices[index] = {
                "device": index,
                "segments": 0,
                "blocks": 0,
                "reserved_bytes": 0,
                "allocated_bytes": 0,
                "requested_bytes": 0,
                "active_bytes": 0,
                "pending_free_bytes": 0,
                "inactive_bytes": 0,
                "largest_inactive_block": 0,
                "large_segments": 0,
                "small_segments": 0,
            }
        return devices[index]

    for seg in snapshot.get("segments", []):
        d = dev(int(seg.get("device", 0) or 0))
        d["segments"] += 1
        d["reserved_bytes"] += int(seg.get("total_size", 0) or 0)
        if seg.get("segment_type") == "small":
            d["small_segments"] += 1
        else:
            d["large_segments"] += 1
        for block in _blocks(seg):
            size = int(block.get("size", 0) or 0)
            state = str(block.get("state", ""))
            d["blocks"] += 1
            if state == "active_allocated":
                d["allocated_bytes"] += size
                d["active_bytes"] += size
                d["requested_bytes"] += int(block.get("requested_size", size) or 0)
            elif state in ACTIVE_STATES:
                d["pending_free_bytes"] += size
                d["active_bytes"] += size
            else:
                d["inactive_bytes"] += size
                d["largest_inactive_block"] = max(d["largest_inactive_block"], size)
            if state in ACTIVE_STATES:
                frames = block.get("frames") or []
                if frames:
                    blocks_with_frames += 1
                live.append((size, d["device"], block))
                site = allocation_site(frames) or NO_STACK
                entry = sites.setdefault(
                    site, {"site": site, "bytes": 0, "blocks": 0, "devices": set(), "stack": _short_stack(frames)}
                )
                entry["bytes"] += size
                entry["blocks"] += 1
                entry["devices"].add(d["device"])

    live.sort(key=lambda item: item[0], reverse=True)
    largest = [
        {
            "device": device,
            "address": hex(int(b.get("address", 0) or 0)),
            "size": size,
            "requested_size": int(b.get("requested_size", size) or 0),
            "state": b.get("state"),
            "site": allocation_site(b.get("frames")),
            "stack": _short_stack(b.get("frames")),
        }
        for size, device, b in live[:top]
    ]
    top_sites = sorted(sites.values(), key=lambda s: s["bytes"], reverse=True)[:top]
    for s in top_sites:
        s["devices"] = sorted(s["devices"])

    traces = snapshot.get("device_traces") or []
    history: list[dict[str, Any]] = []
    ooms: list[dict[str, Any]] = []
    entries_with_frames = 0
    for index, entries in enumerate(traces):
        if not entries:
            continue
        actions = Counter(str(e.get("action")) for e in entries)
        times = [e["time_us"] for e in entries if isinstance(e.get("time_us"), (int, float)) and e["time_us"]]
        entries_with_frames += sum(1 for e in entries if e.get("frames"))
        history.append(
            {
                "device": index,
                "entries": len(entries),
                "actions": dict(actions),
                "span_s": round((max(times) - min(times)) / 1e6, 3) if len(times) > 1 else None,
            }
        )
        for e in entries:
            if e.get("action") == "oom":
                ooms.append(
                    {
                        "device": index,
                        "requested_bytes": int(e.get("size", 0) or 0),
                        "device_free_bytes": int(e.get("device_free", e.get("addr", 0)) or 0),
                        "site": allocation_site(e.get("frames")),
                        "stack": _short_stack(e.get("frames")),
                    }
                )
        dev(index)  # a device with history but no segments still appears

    # Every device, those seen in the history only included (after empty_cache(), say).
    for d in devices.values():
        inactive = d["inactive_bytes"]
        # External fragmentation: how much of the cached free memory is unusable for one
        # allocation as large as all of it (0: one free block; near 1: scattered crumbs).
        d["fragmentation"] = round(1 - d["largest_inactive_block"] / inactive, 4) if inactive else 0.0
        d["cached_free_fraction"] = round(inactive / d["reserved_bytes"], 4) if d["reserved_bytes"] else 0.0

    return {
        "schema": SUMMARY_SCHEMA,
        "schema_version": SUMMARY_VERSION,
        "devices": [devices[k] for k in sorted(devices)],
        "totals": {
            k: sum(d[k] for d in devices.values())
            for k in ("reserved_bytes", "allocated_bytes", "active_bytes", "inactive_bytes", "segments", "blocks")
        },
        "largest_blocks": largest,
        "top_sites": top_sites,
        "history": history,
        "history_recorded": bool(history) or blocks_with_frames > 0,
        "stacks_recorded": blocks_with_frames > 0 or entries_with_frames > 0,
        "oom_events": ooms,
        "allocator_settings": snapshot.get("allocator_settings"),
    }


def manifest_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The few fields that go into the manifest and the CLI's one-line result."""
    top = summary["top_sites"][0] if summary.get("top_sites") else None
    failing = summary.get("failing_allocation") or {}
    return {
        "trigger": summary.get("trigger"),
        "memory_history": summary.get("memory_history"),
        "allocated_bytes": summary["totals"]["allocated_bytes"],
        "reserved_bytes": summary["totals"]["reserved_bytes"],
        "failing_device": failing.get("device"),
        "failing_bytes": failing.get("requested_bytes"),
        "top_site": top["site"] if top else None,
        "top_site_bytes": top["bytes"] if top else None,
        "capture_s": (summary.get("capture") or {}).get("total_s"),
        "pickle_bytes": (summary.get("capture") or {}).get("pickle_bytes"),
        "advice": [a.get("rule") for a in summary.get("advice") or [] if isinstance(a, dict)],
    }
