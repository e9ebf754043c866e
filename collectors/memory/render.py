"""Memory snapshots rendered: text for ``dynprof show`` and ``dynprof memory-report``, and a
self-contained HTML page for ``dynprof memory-report``.

:func:`render_artifact` is the ``memory`` kind's renderer (``dynprof show``): the summary of an
artifact and its text. :func:`format_summary` is the text of a summary; :func:`render_html` the
page of a snapshot and its summary.

The HTML page opens with no network. PyTorch's interactive viewer
(``torch.cuda._memory_viz.trace_plot`` / ``segment_plot``) is a page that imports MemoryViz.js
from cdn.jsdelivr.net, which imports d3 from cdn.skypack.dev; neither script ships in the torch
wheel, so that page is blank on a machine without internet (the usual place for a training
cluster). This report therefore draws its own static views (timeline of active and reserved
memory over the recorded events, the allocator's segments with their blocks, the top allocation
sites and the largest blocks) in inline SVG and HTML, and embeds the text views that the
installed torch's own ``_memory_viz`` renders offline (``segsum``: the segment map; ``trace``:
the event history as code). It has no scripts and no external references; the snapshot itself
can be embedded as a download link for pytorch.org/memory_viz.
"""

from __future__ import annotations

import base64
import html
import zlib
from collections.abc import Callable
from typing import Any

from collectors.memory import STACK_FILE
from collectors.memory.reader import read_summary
from collectors.memory.summary import ACTIVE_STATES, NO_STACK, allocation_site, format_frame
from dynprof.safetext import one_line
from dynprof.units import human_bytes


# -- text ---------------------------------------------------------------------------------------------
def _b(n: Any) -> str:
    return human_bytes(n, digits=2)


def oom_sentence(failing: dict[str, Any]) -> str:
    """One line on the failed allocation: size, site, and what limited it."""
    where = f" at {failing['site']}" if failing.get("site") else ""
    free, limit = failing.get("device_free_bytes"), failing.get("device_limit_bytes")
    head = f"CUDA out of memory on cuda:{failing.get('device')}: tried to allocate {_b(failing.get('requested_bytes'))}{where}"
    if isinstance(free, int) and isinstance(limit, int) and free > limit:
        # The allocator refused because of the process's cap, not because the device was full.
        return f"{head}; the process is capped at {_b(limit)} (set_per_process_memory_fraction), {_b(free)} free on the device"
    return f"{head}; {_b(free)} free of {_b(limit)}"


def format_summary(summary: dict[str, Any], top: int = 10) -> str:
    lines: list[str] = []
    failing = summary.get("failing_allocation")
    if summary.get("trigger"):
        lines.append(
            f"trigger: {summary['trigger']}   memory history: {summary.get('memory_history', '?')}"
            + (f"   torch {summary['torch_version']}" if summary.get("torch_version") else "")
        )
    if failing:
        lines.append(oom_sentence(failing))
    if not failing:
        for o in (summary.get("oom_events") or [])[-3:]:
            where = f" at {o['site']}" if o.get("site") else ""
            lines.append(
                f"recorded OOM on cuda:{o['device']}: tried to allocate {_b(o['requested_bytes'])}{where}; "
                f"{_b(o['device_free_bytes'])} free"
            )
    live = summary.get("device_memory") or {}
    lines.append("")
    lines.append(
        f"{'device':<8} {'allocated':>11} {'active':>11} {'reserved':>11} {'cached free':>11} "
        f"{'frag':>5} {'free (CUDA)':>12} {'total':>11} {'segments':>8}"
    )
    for d in summary.get("devices", []):
        device, allocated, active, reserved, cached_free, frag, free, total, segments = _device_cells(d, live)
        lines.append(
            f"{device:<8} {allocated:>11} {active:>11} {reserved:>11} {cached_free:>11} {frag:>5} "
            f"{free:>12} {total:>11} {segments:>8}"
        )
    sites = summary.get("top_sites") or []
    if sites:
        lines.append("")
        if not summary.get("stacks_recorded"):
            note = " — no stacks: memory history was off"
        elif str(summary.get("memory_history", "")).startswith("auto"):
            with_stack = sum(s["bytes"] for s in sites if s["site"] != NO_STACK)
            note = (
                " — sampled: `auto` records stacks in windows, so only blocks allocated during one have a site"
                f" ({_b(with_stack)} of the top sites' bytes)"
            )
        else:
            note = ""
        lines.append(f"top allocation sites (live blocks, by bytes){note}:")
        for s in sites[:top]:
            lines.append(f"  {_b(s['bytes']):>11}  {s['blocks']:>6} blocks  {s['site']}")
    largest = summary.get("largest_blocks") or []
    if largest:
        lines.append("")
        lines.append("largest live blocks:")
        for b in largest[:top]:
            lines.append(f"  {_b(b['size']):>11}  cuda:{b['device']} {b['address']}  {b.get('site') or NO_STACK}")
    if not summary.get("stacks_recorded") and summary.get("size_classes"):
        lines.append("")
        lines.append("blocks by pool and size class (no stacks recorded):")
        for r in summary["size_classes"]:
            if r["state"] == "allocated":
                lines.append(
                    f"  cuda:{r['device']} {r['pool']:<5} {r['size_class']:<14} {r['blocks']:>7} blocks {_b(r['bytes']):>11}"
                )
    att = summary.get("attribution")
    if isinstance(att, dict):
        lines.append("")
        lines.append(
            f"held by the job's objects: parameters {_b(att.get('parameters_bytes'))}, gradients "
            f"{_b(att.get('gradients_bytes'))}, optimizer state {_b(att.get('optimizer_state_bytes'))} "
            f"({att.get('optimizers', 0)} optimizers); tensors in the failing frames {_b(att.get('frame_tensors_bytes'))}"
        )
        for t in (att.get("frame_tensors") or [])[:5]:
            many = f" {t.get('tensors')} tensors, e.g." if int(t.get("tensors", 1) or 1) > 1 else ""
            lines.append(
                f"  {_b(t.get('bytes')):>11}  {t.get('name')}{many} {t.get('dtype')}{t.get('shape')}  in {t.get('frame')}"
            )
    advice = summary.get("advice") or []
    if advice:
        lines.append("")
        lines.append("advice:")
        for a in advice:
            lines.append(f"  [{a.get('rule')}] {a.get('reason')}")
            lines.append(f"      -> {a.get('advice')}")
    hist = summary.get("history") or []
    lines.append("")
    if hist:
        for h in hist:
            acts = ", ".join(f"{k} {v}" for k, v in sorted(h["actions"].items()))
            span = f" over {h['span_s']} s" if h.get("span_s") is not None else ""
            lines.append(f"history cuda:{h['device']}: {h['entries']} events{span} ({acts})")
    else:
        lines.append("history: none recorded (recording was off, or nothing was allocated since it started)")
    cap = summary.get("capture")
    if cap:
        lines.append(
            f"capture: {cap['total_s']} s (snapshot {cap['snapshot_s']} s, pickle {cap['pickle_s']} s, "
            f"{_b(cap['pickle_bytes'])}, {cap['history_entries']} history events)"
        )
    return "\n".join(one_line(line) for line in lines)


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of a memory artifact, for ``dynprof show``."""
    summary = read_summary(artifact)
    text = format_summary(summary)
    if artifact.has_file(STACK_FILE):
        stack = artifact.read_text(STACK_FILE).rstrip()
        tail = stack.splitlines()[-12:]
        text += (
            "\n\nstack of the thread that "
            + ("hit the OOM" if summary.get("trigger") == "oom" else "took it")
            + " (innermost last):\n"
            + "\n".join(tail)
        )
    return summary, text


# -- HTML ---------------------------------------------------------------------------------------------
PALETTE = ["#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7", "#9c755f", "#bab0ab"]
MAX_SEGMENTS_DRAWN = 200
MAX_TIMELINE_POINTS = 1500
MAX_TRACE_LINES = 4000


def _device_cells(d: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """One device of the summary as its table shows it, in both renderers: its name, the bytes
    allocated, active, reserved and cached free, the fragmentation, the free and total bytes as
    CUDA says them (``live``: the process's device memory, by device; ``-`` when not read), and
    its segments."""
    extra = live.get(str(d["device"]), {})
    return [
        f"cuda:{d['device']}",
        _b(d["allocated_bytes"]),
        _b(d["active_bytes"]),
        _b(d["reserved_bytes"]),
        _b(d["inactive_bytes"]),
        f"{d['fragmentation']:.2f}",
        _b(extra.get("free_bytes")) if extra else "-",
        _b(extra.get("total_bytes")) if extra else "-",
        str(d["segments"]),
    ]


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _color(key: str) -> str:
    return PALETTE[zlib.crc32(key.encode()) % len(PALETTE)]


def timeline(snapshot: dict[str, Any], device: int, final_active: int, final_reserved: int) -> dict[str, Any] | None:
    """Active and reserved bytes after each recorded event of ``device``. The history is a
    ring buffer that starts mid-run, so the level before its first event is inferred from the
    snapshot's current totals."""
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        return None
    events = traces[device]
    d_active = d_reserved = 0
    deltas: list[tuple[int, int]] = []
    ooms: list[tuple[int, dict[str, Any]]] = []
    for i, e in enumerate(events):
        action, size = e.get("action"), int(e.get("size", 0) or 0)
        da = dr = 0
        if action == "alloc":
            da = size
        elif action == "free_completed":
            da = -size
        elif action in ("segment_alloc", "segment_map"):
            dr = size
        elif action in ("segment_free", "segment_unmap"):
            dr = -size
        elif action == "oom":
            ooms.append((i, e))
        d_active += da
        d_reserved += dr
        deltas.append((da, dr))
    active, reserved = final_active - d_active, final_reserved - d_reserved
    a_series, r_series = [], []
    for da, dr in deltas:
        active += da
        reserved += dr
        a_series.append(active)
        r_series.append(reserved)
    return {"active": a_series, "reserved": r_series, "ooms": ooms, "events": len(events)}


def _bucket_max(series: list[int], n: int) -> list[int]:
    if len(series) <= n:
        return series
    size = len(series) / n
    return [max(series[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)]) for i in range(n)]


def timeline_svg(tl: dict[str, Any], width: int = 960, height: int = 240) -> str:
    active = _bucket_max(tl["active"], MAX_TIMELINE_POINTS)
    reserved = _bucket_max(tl["reserved"], MAX_TIMELINE_POINTS)
    top = max(max(reserved, default=0), max(active, default=0), 1)
    left, bottom = 70, 20
    w, h = width - left - 10, height - bottom - 10

    def pts(series: list[int]) -> str:
        n = max(len(series) - 1, 1)
        return " ".join(f"{left + i * w / n:.1f},{10 + h - v / top * h:.1f}" for i, v in enumerate(series))

    parts = [
        f'<svg width="{width}" height="{height}" role="img">',
        f'<rect x="{left}" y="10" width="{w}" height="{h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = 10 + h - frac * h
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{_e(_b(top * frac))}</text>'
        )
    parts.append(
        f'<polyline fill="none" stroke="#9c755f" stroke-width="1.5" points="{pts(reserved)}">'
        "<title>reserved (segments)</title></polyline>"
    )
    parts.append(
        f'<polyline fill="none" stroke="#4e79a7" stroke-width="1.5" points="{pts(active)}">'
        "<title>active (allocated + awaiting free)</title></polyline>"
    )
    n = max(tl["events"] - 1, 1)
    for i, e in tl["ooms"]:
        x = left + i * w / n
        site = allocation_site(e.get("frames")) or ""
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="10" y2="{10 + h}" stroke="#d62728" stroke-width="2">'
            f"<title>OOM: requested {_e(_b(e.get('size')))}, {_e(_b(e.get('device_free')))} free "
            f"{_e(site)}</title></line>"
        )
    parts.append(f'<text x="{left}" y="{height - 4}" font-size="10">event 0</text>')
    parts.append(f'<text x="{left + w}" y="{height - 4}" font-size="10" text-anchor="end">event {tl["events"]}</text>')
    parts.append("</svg>")
    return "".join(parts)


def segments_svg(snapshot: dict[str, Any], device: int, width: int = 960) -> tuple[str, int]:
    segs = [s for s in snapshot.get("segments", []) if int(s.get("device", 0) or 0) == device]
    segs.sort(key=lambda s: int(s.get("total_size", 0) or 0), reverse=True)
    shown = segs[:MAX_SEGMENTS_DRAWN]
    if not shown:
        return "", 0
    biggest = max(int(s.get("total_size", 1) or 1) for s in shown)
    row_h, left = 14, 90
    w = width - left - 10
    parts = [f'<svg width="{width}" height="{len(shown) * row_h + 4}" role="img">']
    for r, seg in enumerate(shown):
        y = 2 + r * row_h
        total = int(seg.get("total_size", 0) or 0)
        seg_w = max(total / biggest * w, 2)
        parts.append(f'<text x="{left - 4}" y="{y + 10}" font-size="10" text-anchor="end">{_e(_b(total))}</text>')
        parts.append(
            f'<rect x="{left}" y="{y}" width="{seg_w:.1f}" height="{row_h - 3}" fill="#fff" stroke="#333" '
            f'stroke-width="0.5"><title>segment {hex(int(seg.get("address", 0) or 0))} '
            f"{_e(_b(total))} ({_e(seg.get('segment_type', '?'))}, stream {_e(seg.get('stream', 0))})"
            "</title></rect>"
        )
        offset = 0
        for block in seg.get("blocks") or []:
            size = int(block.get("size", 0) or 0)
            state = str(block.get("state", ""))
            x = left + offset / max(total, 1) * seg_w
            bw = size / max(total, 1) * seg_w
            offset += size
            if state not in ACTIVE_STATES or bw <= 0:
                continue
            site = allocation_site(block.get("frames")) or NO_STACK
            fill = "#d62728" if state != "active_allocated" else _color(site)
            stack = "\n".join(format_frame(f) for f in (block.get("frames") or [])[:12])
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{max(bw, 0.5):.2f}" height="{row_h - 3}" fill="{fill}">'
                f"<title>{_e(_b(size))} {_e(state)}\n{_e(site)}\n{_e(stack)}</title></rect>"
            )
    parts.append("</svg>")
    return "".join(parts), len(segs)


def _torch_text_views(snapshot: dict[str, Any]) -> list[tuple[str, str]]:
    """The installed torch's own offline renderers; skipped without torch."""
    try:
        from torch.cuda import _memory_viz  # type: ignore[attr-defined]
    except Exception as exc:
        return [("torch._memory_viz", f"(not available here: {type(exc).__name__}: {exc})")]
    views = []
    for name, fn in (("segsum", "segsum"), ("trace", "trace")):
        try:
            text = str(getattr(_memory_viz, fn)(snapshot))
        except Exception as exc:
            text = f"(torch.cuda._memory_viz.{fn} failed on this snapshot: {type(exc).__name__}: {exc})"
        lines = text.splitlines()
        if len(lines) > MAX_TRACE_LINES:
            text = f"(last {MAX_TRACE_LINES} of {len(lines)} lines)\n" + "\n".join(lines[-MAX_TRACE_LINES:])
        views.append((f"torch.cuda._memory_viz.{name}", text))
    return views


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} pre{font-size:12px;background:#f6f6f6;padding:8px;overflow:auto;max-height:480px}
.oom{background:#fdecea;border:1px solid #e15759;padding:8px 12px;margin:12px 0} .muted{color:#777;font-size:12px}
code{font-size:12px}
"""


def _listing(out: list[str], items: Any, head: str, line: Callable[[Any], str], close: str = "</table>") -> None:
    """A section of the page, one line per item, where there are items."""
    if items:
        out.append(head)
        out.extend(line(item) for item in items)
        out.append(close)


def _site_row(s: dict[str, Any]) -> str:
    stack = "\n".join(s.get("stack") or [])
    return (
        f"<tr><td class=n>{_e(_b(s['bytes']))}</td><td class=n>{s['blocks']}</td><td>"
        f"<details><summary><code>{_e(s['site'])}</code></summary><pre>{_e(stack)}</pre></details>"
        "</td></tr>"
    )


def _block_row(b: dict[str, Any]) -> str:
    return (
        f"<tr><td class=n>{_e(_b(b['size']))}</td><td>cuda:{b['device']}</td><td><code>{_e(b['address'])}"
        f"</code></td><td><code>{_e(b.get('site') or NO_STACK)}</code></td></tr>"
    )


def _history_item(h: dict[str, Any]) -> str:
    acts = ", ".join(f"{_e(k)} {v}" for k, v in sorted(h["actions"].items()))
    return f"<li>cuda:{h['device']}: {h['entries']} events ({acts})</li>"


def render_html(
    snapshot: dict[str, Any], summary: dict[str, Any], title: str, source: str, pickle_bytes: bytes | None = None
) -> str:
    out: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">source: <code>{_e(source)}</code>',
    ]
    if summary.get("trigger"):
        out.append(
            f" &middot; trigger: {_e(summary['trigger'])} &middot; memory history: "
            f"{_e(summary.get('memory_history', '?'))}"
        )
    if summary.get("torch_version"):
        out.append(f" &middot; torch {_e(summary['torch_version'])}")
    out.append("</p>")
    failing = summary.get("failing_allocation")
    if failing:
        out.append(
            f'<div class="oom"><b>{_e(oom_sentence(dict(failing, site=None)))}</b>'
            + (f"<br>at <code>{_e(failing['site'])}</code>" if failing.get("site") else "")
            + "</div>"
        )
    if not summary.get("history_recorded"):
        out.append(
            '<div class="oom">This snapshot has no allocation history and no stacks: memory history was off '
            "in the process. Blocks are shown without where they were allocated. Record history with "
            "<code>dynprof run --memory-history N</code> or <code>dynprof memory --history-start N</code>.</div>"
        )

    live = summary.get("device_memory") or {}
    out.append(
        "<h2>Devices</h2><table><tr><th>device</th><th class=n>allocated</th><th class=n>active</th>"
        "<th class=n>reserved</th><th class=n>cached free</th><th class=n>fragmentation</th>"
        "<th class=n>free (CUDA)</th><th class=n>total</th><th class=n>segments</th><th class=n>blocks</th></tr>"
    )
    for d in summary.get("devices", []):
        device, *figures = [*_device_cells(d, live), str(d["blocks"])]
        out.append(f"<tr><td>{_e(device)}</td>" + "".join(f"<td class=n>{_e(f)}</td>" for f in figures) + "</tr>")
    out.append(
        "</table><p class=muted>fragmentation: 1 &minus; largest cached free block / all cached free memory.</p>"
    )

    for d in summary.get("devices", []):
        tl = timeline(snapshot, d["device"], d["active_bytes"], d["reserved_bytes"])
        if tl is not None:
            out.append(f"<h2>cuda:{d['device']}: memory over the last {tl['events']} allocator events</h2>")
            out.append(timeline_svg(tl))
            out.append(
                '<p class=muted><span style="color:#4e79a7">&#9632;</span> active &nbsp; '
                '<span style="color:#9c755f">&#9632;</span> reserved &nbsp; '
                '<span style="color:#d62728">|</span> OOM (hover for details)</p>'
            )
        svg, total = segments_svg(snapshot, d["device"])
        if svg:
            note = f" (the {MAX_SEGMENTS_DRAWN} largest of {total})" if total > MAX_SEGMENTS_DRAWN else ""
            out.append(f"<h2>cuda:{d['device']}: segments and live blocks{note}</h2>")
            out.append(
                "<p class=muted>One row per cudaMalloc'd segment, largest first, scaled to the largest; "
                "coloured blocks are live (colour = allocation site, red = freed but awaiting its stream), "
                "white is cached free memory. Hover a block for its size and stack.</p>"
            )
            out.append(svg)

    _listing(
        out,
        summary.get("top_sites"),
        "<h2>Top allocation sites (live blocks, by bytes)</h2><table><tr><th class=n>bytes</th>"
        "<th class=n>blocks</th><th>site</th></tr>",
        _site_row,
    )
    _listing(
        out,
        summary.get("largest_blocks"),
        "<h2>Largest live blocks</h2><table><tr><th class=n>size</th><th>device</th><th>address</th><th>site</th></tr>",
        _block_row,
    )
    _listing(out, summary.get("history"), "<h2>Recorded history</h2><ul>", _history_item, "</ul>")
    cap = summary.get("capture")
    if cap:
        out.append(
            f"<p class=muted>captured in {cap['total_s']} s (snapshot {cap['snapshot_s']} s, pickle "
            f"{cap['pickle_s']} s, {_e(_b(cap['pickle_bytes']))})</p>"
        )

    out.append(
        "<h2>PyTorch's own views</h2><p class=muted>Rendered by the installed torch's "
        "<code>torch.cuda._memory_viz</code> text renderers. Its interactive page "
        "(<code>trace_plot</code>) loads its scripts from a CDN; write it with "
        "<code>dynprof memory-report --torch-viz FILE</code> where the browser has internet, or open the "
        "snapshot at pytorch.org/memory_viz.</p>"
    )
    for name, text in _torch_text_views(snapshot):
        out.append(f"<details><summary><code>{_e(name)}</code></summary><pre>{_e(text)}</pre></details>")
    if pickle_bytes is not None:
        data = base64.b64encode(pickle_bytes).decode()
        out.append(
            f'<p><a download="snapshot.pickle" href="data:application/octet-stream;base64,{data}">'
            "Save the snapshot pickle</a> (drop it on pytorch.org/memory_viz).</p>"
        )
    out.append("</body></html>\n")
    return "\n".join(out)
