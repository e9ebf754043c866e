"""The job-wide report as text: nodes by checks, the peers compared, the link tests, what to
drain and why (``dynprof healthcheck --hosts/--slurm/--srun`` without ``--json``)."""

from __future__ import annotations

from dynprof.output import printable, table
from healthcheck.fleet import MIN_PEER_NODES, FleetReport


def render_fleet(report: FleetReport, failures_only: bool = False) -> str:
    """Nodes x checks: a column for every check that is not a pass (or skipped) everywhere."""
    cells = [v.check_cells() for v in report.verdicts]
    names: list[str] = list(dict.fromkeys(name for row in cells for name in row))
    shown = [n for n in names if any(row.get(n) not in (None, "pass", "skipped") for row in cells)]
    rows = []
    for v, row in zip(report.verdicts, cells, strict=True):
        if failures_only and v.status == "healthy":
            continue
        first = v.reasons[0].describe() if v.reasons else (v.warnings[0].describe() if v.warnings else "")
        more = len(v.reasons) + (len(v.warnings) if not v.reasons else 0) - 1
        reason = first + (f" (+{more} more)" if more > 0 else "")
        rows.append(
            [v.outcome.label, v.status.upper() if v.drain else v.status, *(row.get(n, "") for n in shown), reason]
        )
    counts = report.counts()
    head = (
        f"dynprof healthcheck: {counts['nodes']} nodes ({report.how}), level {report.level or '-'}"
        + (f", {report.duration_s:.1f} s" if report.duration_s is not None else "")
        + f"; {counts['healthy']} healthy, {counts['warning']} warning, {counts['unhealthy']} unhealthy, "
        f"{counts['unknown']} not checked"
    )
    compared = [p for p in report.peers if p.compared]
    peer_line = (
        f"peers: {len(compared)} of {len(report.peers)} figures compared across nodes "
        f"(slow: more than {report.threshold:.0%} below the fleet median"
        + (f"; under {MIN_PEER_NODES} nodes, no median" if len(compared) < len(report.peers) else "")
        + ")"
    )
    lines = [head, peer_line, ""]
    lines.append(table(rows, ["NODE", "VERDICT", *shown, "REASON"]) if rows else "(no node to show)")
    passed = len(names) - len(shown)
    if passed:
        lines.append(f"({passed} other check(s) passed or were skipped on every node that answered)")
    if report.links is not None:
        rounds = report.links.get("rounds") or []
        named = [f for f in report.links.get("findings") or [] if f.get("isolated")]
        lines.append(
            f"links: {len(rounds)} round(s) of pair tests ({report.links.get('backend')}, "
            f"{report.links.get('pattern')}); " + (f"{len(named)} node(s) named" if named else "no node named")
        )
        for note in report.links.get("notes") or []:
            lines.append(printable(f"  note: {note}"))
    drained = report.drained()
    if drained:
        lines += ["", f"drain ({len(drained)}):"]
        for v in drained:
            for r in v.reasons:
                lines.append(printable(f"  {v.outcome.label}: {r.describe()}"))
    lines += ["", f"verdict: {report.verdict.upper()} (exit {report.exit_code})"]
    return "\n".join(lines)
