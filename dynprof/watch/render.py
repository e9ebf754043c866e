"""A verdict for people: the text ``dynprof watch`` prints and ``dynprof show`` shows of a
``verdict`` artifact (its ``verdict.json``, read through :meth:`Verdict.from_json`). What the
nodes said is shown through :func:`dynprof.safetext.one_line`: one printable line per line."""

from __future__ import annotations

from typing import Any

from dynprof.safetext import one_line
from dynprof.watch.model import Verdict

MAX_RANK_LINES = 64


def _age(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def render_verdict_text(verdict: Verdict) -> str:
    lines = [f"{verdict.kind.upper()} job {verdict.job}: {verdict.conclusion}"]
    timing = verdict.evidence.get("timing")
    if isinstance(timing, dict):
        lines.append(
            f"  detected {_age(timing.get('detection_s'))} after the last step; "
            f"verdict {_age(timing.get('verdict_s'))} after detection (look {_age(timing.get('look_s'))})"
        )
    for c in verdict.culprits[:16]:
        rank = f"rank {c.rank}" if c.rank is not None else f"pid {c.pid}"
        lines.append(f"  culprit {rank} on {c.host}: {c.where}: {c.why}")
    if len(verdict.culprits) > 16:
        lines.append(f"  ... {len(verdict.culprits) - 16} more culprit(s)")
    fr = verdict.evidence.get("flight_recorder")
    if isinstance(fr, dict):
        for pg in fr.get("analysis") or []:
            if isinstance(pg, dict) and pg.get("verdict"):
                lines.append(f"  flight recorder, group {pg.get('process_group')}: {pg.get('verdict')}")
        if fr.get("note"):
            lines.append(f"  flight recorder: {fr.get('note')}")
    health = verdict.evidence.get("healthcheck")
    if isinstance(health, dict):
        for node, summary in sorted(health.items()):
            if isinstance(summary, dict):
                problems = [p for p in summary.get("problems") or [] if isinstance(p, dict)]
                said = "; ".join(f"{p.get('name')} {p.get('status')}: {p.get('reason')}" for p in problems[:4])
                lines.append(f"  healthcheck {node}: {summary.get('verdict')}" + (f" ({said})" if said else ""))
    if verdict.nodes_unanswered:
        lines.append("  no answer from: " + ", ".join(verdict.nodes_unanswered[:20]))
    if verdict.ranks:
        lines.append("  rank  host                  step      age  state")
        for r in verdict.ranks[:MAX_RANK_LINES]:
            state = str(r.get("state") or "")
            where = r.get("where")
            if where and where != "?":
                state += f" at {where}"
            step = r.get("step")
            lines.append(
                f"  {r.get('rank')!s:<5} {str(r.get('host'))[:20]:<20} {'?' if step is None else step!s:>6} "
                f"{_age(r.get('last_step_age_s')):>8}  {state}"
            )
        if len(verdict.ranks) > MAX_RANK_LINES:
            lines.append(f"  ... {len(verdict.ranks) - MAX_RANK_LINES} more rank(s)")
    # Each line is one line: a newline in what a node said (a frame's name, a job id) is shown
    # as ``\n``, never a line of its own that would read as part of the verdict.
    return "\n".join(one_line(line) for line in lines)


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Renderer for ``dynprof show`` (kind ``verdict``): the summary and the text of its verdict."""
    verdict = Verdict.from_json(artifact.read_json("verdict.json"))
    summary = {
        "kind": verdict.kind,
        "job": verdict.job,
        "conclusion": verdict.conclusion,
        "culprits": [c.to_json() for c in verdict.culprits],
        "timing": verdict.evidence.get("timing"),
        "nodes_unanswered": verdict.nodes_unanswered,
    }
    return summary, render_verdict_text(verdict)
