"""An analysis as text: the per-rank table, the straggler verdict, the top kernels and
operators (:func:`render_text`); two analyses compared (:func:`render_compare_text`); and an
``analysis`` artifact's summary for ``dynprof show`` and the web page (:func:`render_artifact`).
Every line is one printable line (:func:`dynprof.safetext.one_line`): the figures and names
come from traces and files, which are untrusted.
"""

from __future__ import annotations

import math
from typing import Any

from collectors.trace_analysis.artifact import load_analysis
from dynprof.safetext import one_line


def _fmt(v: Any, width: int = 8, nd: int = 1, sign: str = "") -> str:
    """``v`` right-aligned in ``width`` characters with ``nd`` decimals; a value too large for
    that in 3 significant digits (1.23e+15), never a 150-digit number; ``-`` for none or NaN."""
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return f"{'-':>{width}}"
    if not math.isfinite(x):
        return f"{'-':>{width}}"
    text = f"{x:{sign}.{nd}f}"
    if len(text) > width:
        text = f"{x:{sign}.3g}"
    return f"{text:>{width}}"


def render_text(analysis: dict[str, Any], top: int = 10) -> str:
    ranks = analysis.get("ranks") or []
    common = analysis.get("common_steps") or []
    lines = []
    backends = sorted({str(r.get("backend")) for r in ranks if r.get("backend")})
    gpu = any(r.get("gpu") for r in ranks)
    step_text = f"steps {common[0]}-{common[-1]} ({len(common)} in every rank)" if common else "no common steps"
    lines.append(
        f"{len(ranks)} rank(s), {step_text}; backend {', '.join(backends) or '-'}; "
        f"{'GPU' if gpu else 'CPU-only'} traces"
    )
    lines.append("")
    lines.append("ms per step, mean over steps; each row's categories add up to STEP")
    head = f"{'RANK':>4} {'HOST':<12} {'STEP':>8} | {'CPU OPS':>8} {'COLL':>8} {'WAIT':>8} {'OUTSIDE':>8}"
    if gpu:
        head += f" | {'COMPUTE':>8} {'OVERLAP':>8} {'COMM':>8} {'MEMCPY':>8} {'IDLE':>8} {'OVLP%':>6}"
    lines.append(head)
    for r in ranks:
        c = r["cpu"]
        row = (
            f"{r['rank'] if r['rank'] is not None else '-':>4} {str(r.get('host') or '-')[:12]:<12} "
            f"{_fmt(r['step_ms'])} | {_fmt(c['ops'])} {_fmt(c['collective'])} {_fmt(c['collective_wait'])} "
            f"{_fmt(c['outside_ops'])}"
        )
        if gpu:
            g = r.get("gpu") or {}
            row += (
                f" | {_fmt(g.get('compute'))} {_fmt(g.get('comm_overlap'))} {_fmt(g.get('comm'))} "
                f"{_fmt(g.get('memcpy'))} {_fmt(g.get('idle'))} {_fmt(r.get('overlap_pct'), 6)}"
            )
        lines.append(row)
    lines.append("")
    s = analysis.get("straggler")
    if s:
        lines.append(f"STRAGGLER on {s.get('host') or '?'}: {s['reason']}")
    lines.append(f"({analysis.get('straggler_check', '')})")
    for key, title in (("top_kernels", "top GPU kernels"), ("top_ops", "top CPU operators (self time)")):
        rows = (analysis.get(key) or [])[:top]
        if not rows:
            continue
        lines.append("")
        lines.append(f"{title:<60} {'calls':>7} {'total ms':>10} {'ms/step/rank':>12} {'max on':>7}")
        for row in rows:
            lines.append(
                f"{str(row['name'])[:60]:<60} {row['count']:>7} {_fmt(row['self_ms'], 10, 3)} "
                f"{_fmt(row['ms_per_step_per_rank'], 12, 3)} {'rank ' + str(row['max_rank']):>7}"
            )
    for e in analysis.get("errors") or []:
        lines.append(f"not analysed: rank {e.get('rank')}: {e['error']}")
    return "\n".join(one_line(line) for line in lines)


def render_compare_text(result: dict[str, Any], label_a: str, label_b: str) -> str:
    lines = [f"A = {label_a}", f"B = {label_b}", "", "ms per step, mean over ranks"]
    lines.append(f"{'category':<20} {'A':>9} {'B':>9} {'B-A':>9} {'%':>7}")
    for c in result["categories"]:
        lines.append(
            f"{c['category']:<20} {_fmt(c['a_ms'], 9, 2)} {_fmt(c['b_ms'], 9, 2)} "
            f"{_fmt(c['delta_ms'], 9, 2)} {_fmt(c['delta_pct'], 7)}"
        )
    for key, title in (("kernels", "GPU kernels that moved most"), ("ops", "CPU operators that moved most")):
        if not result[key]:
            continue
        lines.append("")
        lines.append(f"{title + ' (ms/step/rank)':<60} {'A':>9} {'B':>9} {'B-A':>9}")
        for row in result[key]:
            lines.append(
                f"{str(row['name'])[:60]:<60} {_fmt(row['a_ms'], 9, 3)} {_fmt(row['b_ms'], 9, 3)} "
                f"{_fmt(row['delta_ms'], 9, 3, sign='+')}"
            )
    for side in ("a", "b"):
        s = result["straggler"][side]
        lines.append(f"straggler in {side.upper()}: " + (s["reason"] if s else "none"))
    return "\n".join(one_line(line) for line in lines)


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Summary of an analysis artifact, for `dynprof show` and the web page."""
    data = load_analysis(artifact)
    summary = {k: data.get(k) for k in ("ranks", "common_steps", "straggler", "straggler_check")}
    return summary, render_text(data)
