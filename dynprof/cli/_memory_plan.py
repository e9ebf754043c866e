"""`dynprof memory plan`'s text: each process's plan (collectors.memory.collect.collect_plan
measures and plans), and the processes that failed."""

from __future__ import annotations

from typing import Any

from collectors.memory.plan import render_text
from collectors.memory.plan_scale import describe
from dynprof.cli._common import printable, table


def render(doc: dict[str, Any]) -> str:
    parts = []
    rows = []
    for r in doc["results"]:
        who = f"rank {r['rank']}" if r["rank"] is not None else "-"
        if r["status"] != "ok":
            rows.append([who, r["pid"], "failed", r["error"]])
            continue
        if "undo" in r:
            parts.append(f"{who}, pid {r['pid']}: " + _undo_text(r))
            continue
        kept = f"\n(kept in {r['artifact']}: `dynprof show` it)" if r.get("artifact") else ""
        sizes = r["plan"].get("micro_batches")
        more = "\n" + "\n".join(describe(sizes)) if sizes else ""
        parts.append(f"{who}, pid {r['pid']}:\n" + render_text(r["plan"]) + more + kept)
    if rows:
        parts.append(table(rows, ["rank", "pid", "status", "result"]))
        parts.extend(
            f"  what to do: {printable(r['help'])}" for r in doc["results"] if r["status"] != "ok" and r.get("help")
        )
    return "\n\n".join(parts)


def _undo_text(r: dict[str, Any]) -> str:
    state = r.get("checkpoint") or {}
    if r["undo"] == "nothing":
        return f"nothing to take back: dynprof wrapped no block ({state.get('state')}: {state.get('detail')})"
    return f"checkpointing taken back: {state.get('detail')}"
