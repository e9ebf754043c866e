"""What a verdict says and where it is kept: the healthcheck clause of its conclusion, and the
``verdict`` artifact it is written as (``dynprof show`` reads it back).
"""

from __future__ import annotations

from typing import Any

from collectors.stacks import Stacks
from dynprof.store import ArtifactStore
from dynprof.watch.model import VERDICT_KIND, Verdict


def health_clause(health: Any) -> str:
    """The conclusion's healthcheck clause: the failing checks of each node (three a node), or ""."""
    if not isinstance(health, dict):
        return ""
    parts = []
    for node, summary in health.items():
        if not isinstance(summary, dict):
            continue
        failing = [p for p in summary.get("problems") or [] if isinstance(p, dict) and p.get("status") == "fail"]
        for p in failing[:3]:
            device = f" GPU {p['device']}" if p.get("device") is not None else ""
            parts.append(f"{node}{device}: {p.get('name')}: {p.get('reason')}")
    return ("; healthcheck: " + "; ".join(parts)) if parts else ""


def write_verdict(verdict: Verdict, stacks: Stacks | None) -> str:
    """The verdict as a ``verdict`` artifact in this machine's store: ``verdict.json`` (the
    verdict document) and, when the watch looked, ``stacks.json`` (the merged stacks
    document); the manifest's summary carries the conclusion. Returns its path."""
    writer = ArtifactStore().create(
        VERDICT_KIND, job=verdict.job, options={"kind": verdict.kind, "culprits": len(verdict.culprits)}
    )
    try:
        writer.write_json("verdict.json", verdict.to_json())
        if stacks is not None:
            writer.write_json("stacks.json", stacks.to_json())
        art = writer.finish(
            "complete",
            summary={
                "kind": verdict.kind,
                "conclusion": verdict.conclusion[:4000],
                "culprits": [c.to_json() for c in verdict.culprits[:16]],
            },
        )
    except BaseException as exc:
        if writer.finished is None:
            writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    return str(art.path)
