"""`dynprof memory plan`'s text: one plan per group of a job's ranks whose measurements agree,
with each rank's figures (collectors.memory.collect.job_plans); each other process's own plan
(collectors.memory.collect.collect_plan measures and plans); and the processes that failed."""

from __future__ import annotations

from typing import Any

from collectors.memory.plan.ranks import ranks_text
from collectors.memory.plan.render import render_text
from collectors.memory.plan.scale import describe
from dynprof.cli._common import human_bytes, printable, table


def render(doc: dict[str, Any]) -> str:
    parts = []
    rows = []
    jobs = doc.get("jobs") or []
    in_jobs = {pid for j in jobs for pid in j["pids"]}
    kept = {r["pid"]: r["artifact"] for r in doc["results"] if r.get("artifact")}
    for j in jobs:
        parts.append(_job_text(j, jobs, kept))
    for r in doc["results"]:
        who = f"rank {r['rank']}" if r["rank"] is not None else "-"
        if r["status"] != "ok":
            rows.append([who, r["pid"], "failed", r["error"]])
            continue
        if "undo" in r:
            parts.append(f"{who}, pid {r['pid']}: " + _undo_text(r))
            continue
        if r["pid"] in in_jobs:
            continue
        saved = f"\n(kept in {r['artifact']}: `dynprof show` it)" if r.get("artifact") else ""
        parts.append(f"{who}, pid {r['pid']}:\n" + _plan_text(r["plan"]) + saved)
    if rows:
        parts.append(table(rows, ["rank", "pid", "status", "result"]))
        parts.extend(
            f"  what to do: {printable(r['help'])}" for r in doc["results"] if r["status"] != "ok" and r.get("help")
        )
    return "\n\n".join(parts)


def _plan_text(plan: dict[str, Any]) -> str:
    sizes = plan.get("micro_batches")
    more = "\n" + "\n".join(describe(sizes)) if sizes else ""
    return render_text(plan) + more


def _job_text(j: dict[str, Any], jobs: list[dict[str, Any]], kept: dict[int, str]) -> str:
    """One group of a job's ranks: who, why one plan (or how they differ), the plan, each rank."""
    ranks, pids = j["ranks"], j["pids"]
    who = f"job {j['job']}, {ranks_text(ranks)} (pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))})"
    tolerance = f"{j['tolerance'] * 100:g} %"
    if len(ranks) > 1:
        head = (
            f"{who}: one plan, their measured steps agree (the same blocks, bytes within {tolerance}); "
            f"planned from the bytes of rank {j['bytes_of']['rank']} (the highest peak) and the times of "
            f"rank {j['times_of']['rank']} (the slowest step)"
        )
    else:
        head = f"{who}: its own plan"
    if j.get("differs_from"):
        head += f"; it differs from {ranks_text(j['differs_from'])}: " + "; ".join(j.get("how") or ["?"])
    else:
        others = [r for g in jobs if g is not j and g["job"] == j["job"] for r in g["ranks"]]
        if others:
            head += f" ({ranks_text(others)} of the job differ{'s' if len(others) == 1 else ''}: below)"
    plan = j["plan"]
    chosen = plan.get("plan") or {}
    rows = [
        [
            "-" if f["rank"] is None else f["rank"],
            f["pid"],
            human_bytes(f["peak_bytes"]),
            f"{(f.get('typical_step_s') or f['step_s']) * 1000:.1f} ms",
            human_bytes(f["predicted_peak_bytes"]) if chosen.get("modules") else "-",
            f"+{f['added_step_s'] * 1000:.1f} ms" if chosen.get("modules") else "-",
        ]
        for f in j["rank_figures"]
    ]
    each = table(rows, ["rank", "pid", "measured peak", "step", "peak with the plan", "recompute"])
    paths = [kept[pid] for pid in pids if pid in kept]
    where = f"\n(each rank's measurement kept in {', '.join(paths)}: `dynprof show` it)" if paths else ""
    return head + "\n" + _plan_text(plan) + "\neach rank, measured and with the plan:\n" + each + where


def _undo_text(r: dict[str, Any]) -> str:
    state = r.get("checkpoint") or {}
    if r["undo"] == "nothing":
        return f"nothing to take back: dynprof wrapped no block ({state.get('state')}: {state.get('detail')})"
    return f"checkpointing taken back: {state.get('detail')}"
