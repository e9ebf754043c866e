"""`dynprof memory plan`'s text: each process's plan (collectors.memory.collect.collect_plan
measures and plans), and the processes that failed."""

from __future__ import annotations

from typing import Any

from collectors.memory.plan import render_text
from dynprof.cli._common import printable, table


def render(doc: dict[str, Any]) -> str:
    parts = []
    rows = []
    for r in doc["results"]:
        who = f"rank {r['rank']}" if r["rank"] is not None else "-"
        if r["status"] != "ok":
            rows.append([who, r["pid"], "failed", r["error"]])
            continue
        kept = f"\n(kept in {r['artifact']}: `dynprof show` it)" if r.get("artifact") else ""
        parts.append(f"{who}, pid {r['pid']}:\n" + render_text(r["plan"]) + kept)
    if rows:
        parts.append(table(rows, ["rank", "pid", "status", "result"]))
        parts.extend(
            f"  what to do: {printable(r['help'])}" for r in doc["results"] if r["status"] != "ok" and r.get("help")
        )
    return "\n\n".join(parts)
