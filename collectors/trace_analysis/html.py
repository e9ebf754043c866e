"""An analysis as HTML for the web page: the straggler verdict and inline SVG, a per-rank stacked
bar of the step breakdown and one step's timeline per rank. No script, no external resource:
the page works offline. Every value is escaped where it is put."""

from __future__ import annotations

import html
from typing import Any

from collectors.trace_analysis.artifact import load_analysis
from collectors.trace_analysis.rank import CPU_CATEGORIES as CPU_CATS
from collectors.trace_analysis.rank import GPU_CATEGORIES as GPU_CATS

COLORS = {
    "ops": "#4e79a7",
    "collective": "#e15759",
    "collective_wait": "#f28e2b",
    "outside_ops": "#bab0ac",
    "compute": "#59a14f",
    "comm_overlap": "#b07aa1",
    "comm": "#e15759",
    "memcpy": "#edc948",
    "idle": "#dddddd",
}
LABELS = {
    "ops": "CPU operators",
    "collective": "in collective ops",
    "collective_wait": "waiting for collectives",
    "outside_ops": "outside operators (Python, data loading)",
    "compute": "GPU compute",
    "comm_overlap": "GPU comm overlapped with compute",
    "comm": "GPU comm (not overlapped)",
    "memcpy": "GPU memcpy/memset",
    "idle": "GPU idle",
}
LANES = [
    ("cpu_ops", "CPU ops", "#4e79a7"),
    ("cpu_collective", "CPU coll", "#e15759"),
    ("cpu_wait", "CPU wait", "#f28e2b"),
    ("gpu_compute", "GPU compute", "#59a14f"),
    ("gpu_comm", "GPU comm", "#e15759"),
    ("gpu_memcpy", "GPU memcpy", "#edc948"),
]
WIDTH = 760
LEFT = 110


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if f == f and f >= 0 else 0.0


def breakdown_svg(analysis: dict[str, Any]) -> str:
    ranks = analysis.get("ranks") or []
    rows: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []
    for r in ranks:
        rows.append((f"rank {r.get('rank')} CPU", r.get("cpu") or {}, CPU_CATS))
        if r.get("gpu"):
            rows.append((f"rank {r.get('rank')} GPU", r["gpu"], GPU_CATS))
    if not rows:
        return ""
    scale_max = max(sum(_num(v.get(k)) for k in cats) for _, v, cats in rows) or 1.0
    bar_h, gap = 18, 6
    plot_w = WIDTH - LEFT - 70  # room for the total after the longest bar
    used = [k for k in (*CPU_CATS, *GPU_CATS) if any(k in cats for _, _, cats in rows)]
    legend_rows = (len(used) + 2) // 3
    height = len(rows) * (bar_h + gap) + 40 + legend_rows * 18
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='breakdown' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' font-family='sans-serif' font-size='11'>"
    ]
    for i, (label, values, cats) in enumerate(rows):
        y = 10 + i * (bar_h + gap)
        out.append(f"<text x='{LEFT - 6}' y='{y + 13}' text-anchor='end'>{_e(label)}</text>")
        x = float(LEFT)
        for k in cats:
            v = _num(values.get(k))
            w = plot_w * v / scale_max
            if w <= 0:
                continue
            out.append(
                f"<rect class='seg {k}' x='{x:.2f}' y='{y}' width='{w:.2f}' height='{bar_h}' fill='{COLORS[k]}'>"
                f"<title>{_e(label)}: {_e(LABELS[k])} {v:.2f} ms/step</title></rect>"
            )
            x += w
        total = sum(_num(values.get(k)) for k in cats)
        out.append(f"<text x='{x + 4:.2f}' y='{y + 13}'>{total:.1f} ms</text>")
    y0 = 10 + len(rows) * (bar_h + gap) + 10
    for j, k in enumerate(used):
        lx = LEFT + (j % 3) * 215
        ly = y0 + (j // 3) * 18
        out.append(f"<rect x='{lx}' y='{ly}' width='10' height='10' fill='{COLORS[k]}'/>")
        out.append(f"<text x='{lx + 14}' y='{ly + 9}'>{_e(LABELS[k])}</text>")
    out.append("</svg>")
    return "".join(out)


def timeline_svg(analysis: dict[str, Any]) -> str:
    tl = analysis.get("timeline")
    if not isinstance(tl, dict) or not tl.get("ranks"):
        return ""
    ranks = tl["ranks"]
    span = max(_num(r.get("step_ms")) for r in ranks) or 1.0
    plot_w = WIDTH - LEFT - 20
    lane_h = 10
    blocks = []
    y = 24
    for r in ranks:
        lanes = r.get("lanes") or {}
        present = [(key, label, color) for key, label, color in LANES if key in lanes]
        blocks.append((r, present, y))
        y += 16 + len(present) * (lane_h + 2) + 8
    height = y + 20
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='timeline' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' font-family='sans-serif' font-size='10'>",
        f"<text x='{LEFT}' y='12'>step {_e(tl.get('step'))}: 0 to {span:.1f} ms from each rank's step start</text>",
    ]
    for r, present, y0 in blocks:
        step_ms = _num(r.get("step_ms"))
        out.append(f"<text x='4' y='{y0 + 10}' font-weight='bold'>rank {_e(r.get('rank'))}</text>")
        out.append(
            f"<rect x='{LEFT}' y='{y0 + 2}' width='{plot_w * step_ms / span:.2f}' height='8' fill='#eeeeee'>"
            f"<title>rank {_e(r.get('rank'))} step {step_ms:.2f} ms</title></rect>"
        )
        ly = y0 + 16
        for key, label, color in present:
            out.append(f"<text x='{LEFT - 6}' y='{ly + 9}' text-anchor='end'>{_e(label)}</text>")
            for seg in (r.get("lanes") or {}).get(key) or []:
                if not isinstance(seg, (list, tuple)) or len(seg) != 2:
                    continue
                s, e = _num(seg[0]), _num(seg[1])
                w = max(plot_w * (e - s) / span, 0.5)
                out.append(
                    f"<rect class='lane {key}' x='{LEFT + plot_w * s / span:.2f}' y='{ly}' width='{w:.2f}' "
                    f"height='{lane_h}' fill='{color}'><title>{_e(label)} {s:.2f}-{e:.2f} ms</title></rect>"
                )
            ly += lane_h + 2
    out.append(f"<line x1='{LEFT}' x2='{LEFT + plot_w}' y1='{height - 16}' y2='{height - 16}' stroke='#999'/>")
    for t in range(5):
        x = LEFT + plot_w * t / 4
        out.append(f"<text x='{x:.1f}' y='{height - 4}' text-anchor='middle'>{span * t / 4:.1f} ms</text>")
    out.append("</svg>")
    return "".join(out)


def analysis_html(analysis: dict[str, Any]) -> str:
    """An HTML fragment: the straggler verdict, the breakdown chart and the timeline."""
    s = analysis.get("straggler")
    verdict = (
        f"<p class='straggler'><b>Straggler: rank {_e(s.get('rank'))}</b> on {_e(s.get('host'))}: {_e(s.get('reason'))}</p>"
        if isinstance(s, dict)
        else "<p class='straggler'>No straggler.</p>"
    )
    check = f"<p><small>{_e(analysis.get('straggler_check', ''))}</small></p>"
    return (
        "<div class='analysis'>"
        + verdict
        + check
        + "<h2>Where each rank's step goes (ms per step)</h2>"
        + breakdown_svg(analysis)
        + "<h2>One step per rank</h2>"
        + timeline_svg(analysis)
        + "</div>"
    )


def render_html(artifact: Any) -> str:
    """Self-contained HTML (inline SVG, no script) of an analysis artifact, for the web page."""
    return analysis_html(load_analysis(artifact))
