"""A ``verdict`` artifact as HTML for the sidecar's page: the conclusion first, then the culprits
(rank, node, where, why), every rank's last step and state, the nodes that did not answer, and
the evidence, each piece folded.

A verdict is untrusted input (a file of the store, written from what the nodes answered): it is
read through :meth:`Verdict.from_json` (bounded), and every value is escaped where it is put,
so that a hostile conclusion, host name or frame stays text. The fragment is self-contained:
no script, no style sheet, nothing loaded from elsewhere (the page's own style applies).
"""

from __future__ import annotations

import html
import json
from typing import Any

from dynprof.safetext import one_line
from dynprof.watch.model import Verdict
from dynprof.watch.signals import rank_columns, signal_of_kind

VERDICT_FILE = "verdict.json"
MAX_VERDICT_BYTES = 32 * 1024 * 1024
MAX_RANK_ROWS = 2000
MAX_EVIDENCE_CHARS = 20_000

_KIND_LABEL = {  # the watch's own kinds; a sampled signal's verdict is headed by its row's label
    "hang": "Hang",
    "busy": "Busy, not hung",
    "agent-down": "Agents down",
    "ok": "No finding",
}


def kind_label(kind: str) -> str:
    """The heading of a verdict of ``kind`` (its own name when none is known)."""
    signal = signal_of_kind(kind)
    return _KIND_LABEL.get(kind) or (signal.label if signal is not None and signal.label else kind)


def _e(value: Any) -> str:
    """A value as escaped text on one line ("-" for none): what a node said is made printable
    first (:func:`dynprof.safetext.one_line`), then escaped for HTML."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return html.escape(f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}")
    return html.escape(one_line(value))


def load_verdict(artifact: Any) -> Verdict:
    """The verdict of a ``verdict`` artifact (its ``verdict.json``, bounded, decoded)."""
    return Verdict.from_json(artifact.read_json(VERDICT_FILE, MAX_VERDICT_BYTES))


def verdict_html(v: Verdict) -> str:
    """The HTML fragment of a verdict."""
    label = kind_label(v.kind)
    parts = [
        f"<section class='verdict {html.escape(v.kind)}'>",
        f"<h2>{html.escape(label)}: job {_e(v.job)}</h2>",
        f"<p class='conclusion'>{_e(v.conclusion)}</p>",
    ]
    if v.culprits:
        rows = "".join(
            f"<tr><td>{_e(c.rank)}</td><td>{_e(c.host)}</td><td>{_e(c.pid)}</td><td><code>{_e(c.where)}</code></td>"
            f"<td>{_e(c.why)}</td><td>{_e(c.since_step)}</td></tr>"
            for c in v.culprits
        )
        parts.append(
            "<h3>Culprits</h3><table class='culprits'><tr><th>RANK</th><th>NODE</th><th>PID</th><th>WHERE</th>"
            f"<th>WHY</th><th>SINCE STEP</th></tr>{rows}</table>"
        )
    if v.ranks:
        shown = v.ranks[:MAX_RANK_ROWS]
        keys = ["rank", "host", "step", "last_step_age_s", "state"]
        extra = [k for k in rank_columns() if any(k in r for r in shown)]  # the signals' own columns
        head = "".join(f"<th>{html.escape(k.upper())}</th>" for k in keys + extra)
        rows = "".join("<tr>" + "".join(f"<td>{_e(r.get(k))}</td>" for k in keys + extra) + "</tr>" for r in shown)
        more = f"<p>... {len(v.ranks) - len(shown)} more rank(s)</p>" if len(v.ranks) > len(shown) else ""
        parts.append(f"<h3>Ranks</h3><table class='ranks'><tr>{head}</tr>{rows}</table>{more}")
    if v.nodes_unanswered:
        nodes = ", ".join(_e(n) for n in v.nodes_unanswered[:200])
        parts.append(f"<p class='failed'>Nodes that did not answer: {nodes}</p>")
    for name, piece in v.evidence.items():
        text = json.dumps(piece, indent=1, sort_keys=True, default=str)
        if len(text) > MAX_EVIDENCE_CHARS:
            text = text[:MAX_EVIDENCE_CHARS] + "\n... (cut)"
        parts.append(
            f"<details class='evidence'><summary>evidence: {_e(name)}</summary><pre>{html.escape(text)}</pre></details>"
        )
    decided = v.decided_at - v.detected_at if v.decided_at and v.detected_at else None
    if decided is not None and decided >= 0:
        parts.append(f"<p class='times'>decided {decided:.1f} s after detection</p>")
    parts.append("</section>")
    return "".join(parts)


def render_html(artifact: Any) -> str:
    """The page's fragment of a ``verdict`` artifact (``HTML_RENDERERS``)."""
    return verdict_html(load_verdict(artifact))
