"""The job's judgement from every rank's figures: the job-wide analysis (the ``analysis.json``
schema: per-rank means over the steps every rank traced, per-step rows, the top kernels and
operators, one step's timeline), which rank holds the others back, and two analyses compared.

Straggler
    Per rank and step, ``collective_ms`` is the time spent waiting in collectives (GPU traces:
    GPU ``comm``; CPU-only traces: CPU ``collective + collective_wait``) and ``work_ms`` the
    rest of the step (:mod:`.rank`). The rank with the most work (mean over the common steps)
    is the straggler when its work exceeds the median of the other ranks' by more than the
    noise threshold (``max(NOISE_FLOOR_MS, NOISE_FRACTION x median step time)``), it is the
    slowest rank in at least half of the steps, and the others spend at least half that excess
    more than it waiting in collectives. docs/analyze.md has the details.
"""

from __future__ import annotations

import os
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from collectors.trace_analysis.artifact import SCHEMA, SCHEMA_VERSION
from collectors.trace_analysis.rank import CPU_CATEGORIES, GPU_CATEGORIES

NOISE_FLOOR_MS = 2.0
NOISE_FRACTION = 0.10


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _r(v: float, nd: int = 3) -> float:
    return round(float(v), nd)


def short_function(name: str) -> str:
    """``file.py(20): load_batch`` -> ``load_batch (file.py:20)``."""
    m = re.match(r"^(.*)\((\d+)\): (.+)$", name)
    if not m:
        return name
    return f"{m.group(3)} ({os.path.basename(m.group(1))}:{m.group(2)})"


def short_collective(name: str) -> str:
    """``c10d::allreduce_`` -> ``allreduce``; ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` ->
    ``AllReduce (nccl)``."""
    m = re.match(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    if m:
        return f"{m.group(1)} (nccl)"
    for prefix in ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:"):
        if name.startswith(prefix):
            return name[len(prefix) :].strip("_")
    return name


def combine(ranks: list[dict[str, Any]], top: int = 15, sources: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The job-wide analysis (the ``analysis.json`` schema) from per-rank results."""
    errors = [r for r in ranks if "error" in r]
    ok = sorted((r for r in ranks if "error" not in r), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    step_sets = [{s["step"] for s in r["steps"]} for r in ok]
    common = sorted(set.intersection(*step_sets)) if step_sets else []
    use = set(common) if common else None

    def rank_steps(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in r["steps"] if use is None or s["step"] in use]

    rank_rows = []
    for r in ok:
        rs = rank_steps(r)
        n = len(rs)
        cpu = {k: _r(_mean([s["cpu"][k] for s in rs])) for k in CPU_CATEGORIES}
        gpu = {k: _r(_mean([s["gpu"][k] for s in rs])) for k in GPU_CATEGORIES} if r["has_gpu"] else None
        comm_total = (gpu["comm"] + gpu["comm_overlap"]) if gpu else 0.0
        rank_rows.append(
            {
                "rank": r["rank"],
                "host": r["host"],
                "artifact": r["artifact"],
                "backend": r["backend"],
                "steps": n,
                "events": r["events"],
                "step_ms": _r(_mean([s["step_ms"] for s in rs])),
                "step_ms_median": _r(_median([s["step_ms"] for s in rs])),
                "cpu": cpu,
                "gpu": gpu,
                "overlap_pct": (_r(100 * gpu["comm_overlap"] / comm_total, 1) if gpu and comm_total > 0 else None),
                "work_ms": _r(_mean([s["work_ms"] for s in rs])),
                "collective_ms": _r(_mean([s["collective_ms"] for s in rs])),
                "device": r.get("device"),
            }
        )
    steps_out = []
    for number in common:
        per_rank = []
        for r in ok:
            s = next(x for x in r["steps"] if x["step"] == number)
            per_rank.append(
                {
                    "rank": r["rank"],
                    "step_ms": _r(s["step_ms"]),
                    "cpu": {k: _r(v) for k, v in s["cpu"].items()},
                    "gpu": {k: _r(v) for k, v in s["gpu"].items()} if s["gpu"] else None,
                    "work_ms": _r(s["work_ms"]),
                    "collective_ms": _r(s["collective_ms"]),
                }
            )
        steps_out.append({"step": number, "ranks": per_rank})
    n_steps = max(1, len(common))
    top_kernels = _top_table([r["kernels"] for r in ok], ok, top, n_steps, lambda v: (v[0], v[1], v[1]))
    top_ops = _top_table([r["ops"] for r in ok], ok, top, n_steps, lambda v: (v[0], v[1], v[2]))
    straggler, check = detect_straggler(ok, rank_rows, n_steps, steps_out)
    timeline = _pick_timeline(ok, common)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "sources": sources or [{"rank": r["rank"], "host": r["host"], "artifact": r["artifact"]} for r in ok],
        "errors": [{"rank": e.get("rank"), "path": e.get("path"), "error": e["error"]} for e in errors],
        "common_steps": common,
        "ranks": rank_rows,
        "steps": steps_out,
        "top_kernels": top_kernels,
        "top_ops": top_ops,
        "straggler": straggler,
        "straggler_check": check,
        "timeline": timeline,
    }


def _top_table(
    tables: list[dict[str, Any]],
    ok: list[dict[str, Any]],
    top: int,
    n_steps: int,
    unpack: Callable[[Any], tuple[float, float, float]],
) -> list[dict[str, Any]]:
    merged: dict[str, list[Any]] = {}
    for table, r in zip(tables, ok):
        for name, v in table.items():
            count, self_ms, total_ms = unpack(v)
            row = merged.setdefault(name, [0, 0.0, 0.0, {}])
            row[0] += count
            row[1] += self_ms
            row[2] += total_ms
            row[3][r["rank"]] = self_ms
    rows = sorted(merged.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    n_ranks = max(1, len(ok))
    out = []
    for name, (count, self_ms, total_ms, per_rank) in rows:
        slowest = max(per_rank.items(), key=lambda kv: kv[1])
        out.append(
            {
                "name": name,
                "count": int(count),
                "self_ms": _r(self_ms),
                "total_ms": _r(total_ms),
                "ms_per_step_per_rank": _r(self_ms / n_steps / n_ranks),
                "max_rank": slowest[0],
                "max_rank_ms": _r(slowest[1]),
            }
        )
    return out


def detect_straggler(
    ok: list[dict[str, Any]], rank_rows: list[dict[str, Any]], n_steps: int, steps: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str]:
    if len(rank_rows) < 2:
        return None, "one rank only: no straggler check"
    median_step = _median([r["step_ms_median"] for r in rank_rows])
    threshold = max(NOISE_FLOOR_MS, NOISE_FRACTION * median_step)
    rule = (
        f"noise threshold {threshold:.1f} ms = max({NOISE_FLOOR_MS:g} ms, "
        f"{NOISE_FRACTION * 100:g}% of the median step {median_step:.1f} ms)"
    )
    idx = max(range(len(rank_rows)), key=lambda i: rank_rows[i]["work_ms"])
    s_row = rank_rows[idx]
    others = [r for i, r in enumerate(rank_rows) if i != idx]
    others_work = _median([r["work_ms"] for r in others])
    others_wait = _median([r["collective_ms"] for r in others])
    excess = s_row["work_ms"] - others_work
    if excess <= threshold:
        return None, (
            f"no straggler: work outside collectives is within {excess:.1f} ms across ranks "
            f"(max rank {s_row['rank']} {s_row['work_ms']:.1f} ms/step vs {others_work:.1f} ms median); {rule}"
        )
    # Noise moves around; a straggler is the slowest rank in most steps.
    slowest = [max(st["ranks"], key=lambda x: x["work_ms"])["rank"] for st in steps]
    wins = sum(1 for r in slowest if r == s_row["rank"])
    if steps and wins * 2 < len(steps):
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more on average but is the slowest "
            f"in only {wins} of {len(steps)} steps; {rule}"
        )
    extra_wait = others_wait - s_row["collective_ms"]
    if extra_wait < 0.5 * excess:
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more, but the others do not wait "
            f"for it in collectives ({others_wait:.1f} ms/step vs {s_row['collective_ms']:.1f}); {rule}"
        )
    s = ok[idx]
    rest = [r for i, r in enumerate(ok) if i != idx]
    where, cause = _explain(s, rest, s_row, others, n_steps)
    shared = _contention(s, rest, cause)
    if shared:
        return None, (
            f"no straggler: rank {s_row['rank']} works {excess:.1f} ms/step more{where}, but {shared}; {rule}"
        )
    coll_name = _top_collective(rest)
    reason = (
        f"rank {s_row['rank']}: {s_row['work_ms']:.1f} ms/step outside collectives{where} vs "
        f"{others_work:.1f} ms on the others; the others wait {others_wait:.1f} ms/step"
        f"{f' in {coll_name}' if coll_name else ' in collectives'}"
    )
    return (
        {
            "rank": s_row["rank"],
            "host": s_row["host"],
            "reason": reason,
            "cause": cause,
            "work_ms": s_row["work_ms"],
            "others_work_ms": _r(others_work),
            "others_wait_ms": _r(others_wait),
            "excess_ms": _r(excess),
            "threshold_ms": _r(threshold),
            "slowest_in_steps": wins,
        },
        f"straggler: rank {s_row['rank']} ({excess:.1f} ms/step over the others); {rule}",
    )


# Two ranks on one GPU do the same GPU work when their kernel and copy counts per step differ by
# at most this share (and their copied bytes by at most COPY_BYTES_TOLERANCE).
WORK_COUNT_TOLERANCE = 0.01
COPY_BYTES_TOLERANCE = 0.01
# Causes on the host's side, which another rank's use of the GPU does not slow.
_HOST_CAUSES = frozenset({"data loading", "input pipeline"})


def _work_per_step(r: dict[str, Any]) -> tuple[float, float, float, float]:
    """A rank's GPU work per traced step, whatever the GPU's speed: kernels, the threads they
    launched (a bigger input launches more), copies, bytes copied."""
    n = max(1, len(r["steps"]))
    kernels = sum(int(v[0]) for v in r["kernels"].values())
    copies = r.get("copies") or {}
    threads = int(r.get("kernel_threads") or 0)
    return kernels / n, threads / n, int(copies.get("count", 0)) / n, int(copies.get("bytes", 0)) / n


def _contention(s: dict[str, Any], rest: list[dict[str, Any]], cause: str) -> str:
    """Why the candidate's extra time is its GPU's contention, not its own slowness ("" where it
    is not): it shares one physical GPU with other ranks of the analysis, its extra time is on the
    GPU's side (not in data loading or the input pipeline), and it does the same GPU work per step
    as they do (kernels, the threads they launch, copies and bytes copied: counted, not timed;
    a trace whose kernels do not say their launch sizes cannot be told apart, and is judged as
    before). Ranks on one GPU take turns
    on it; in a job whose ranks wait for each other, the same rank can lose every turn."""
    device = s.get("device")
    if not device or cause in _HOST_CAUSES or not s.get("kernel_threads"):
        return ""
    peers = [r for r in rest if r.get("device") == device]
    if not peers:
        return ""
    k, t, c, b = _work_per_step(s)
    for p in peers:
        pk, pt, pc, pb = _work_per_step(p)
        if abs(k - pk) > max(1.0, WORK_COUNT_TOLERANCE * max(k, pk)):
            return ""
        if abs(t - pt) > WORK_COUNT_TOLERANCE * max(t, pt):
            return ""
        if abs(c - pc) > max(1.0, WORK_COUNT_TOLERANCE * max(c, pc)):
            return ""
        if abs(b - pb) > max(4096.0, COPY_BYTES_TOLERANCE * max(b, pb)):
            return ""
    names = ", ".join(str(p["rank"]) for p in peers[:8])
    return (
        f"it shares one GPU ({device[:40]}) with rank{'s' if len(peers) > 1 else ''} {names} and does the same GPU "
        f"work per step ({k:.0f} kernels, {c:.0f} {'copy' if round(c) == 1 else 'copies'} of {_mib(b)}): ranks on one GPU take turns on it, so "
        "their GPU-side times differ for no fault of either (give each rank its own GPU to compare them)"
    )


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


# What a CPU operator that holds a straggler's extra time says of its cause.
_DATA_LOADING = re.compile(r"DataLoader|dataloader|__next__|collate", re.IGNORECASE)
_H2D_OPS = re.compile(r"^(cudaMemcpy|cuMemcpy|aten::copy_|aten::_to_copy|aten::to$|Memcpy HtoD|aten::pin_memory)")
_LAUNCH_OPS = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunch|aten::)")


def _explain(
    s: dict[str, Any], rest: list[dict[str, Any]], s_row: dict[str, Any], others: list[dict[str, Any]], n_steps: int
) -> tuple[str, str]:
    """What the straggler spends its extra time on: (text for the reason, cause class). The
    cause is one of "GPU compute", "host launch", "host-to-device copy", "data loading",
    "input pipeline" (Python outside operators), "CPU operators"."""
    cats: dict[str, tuple[float, float]] = {}
    for k in ("ops", "outside_ops"):
        cats["cpu:" + k] = (s_row["cpu"][k], _mean([o["cpu"][k] for o in others]))
    if s_row["gpu"] is not None:
        cats["gpu:memcpy"] = (s_row["gpu"]["memcpy"], _mean([o["gpu"]["memcpy"] if o["gpu"] else 0.0 for o in others]))
        # compute kernels' whole time, overlapped with communication or not
        cats["gpu:compute"] = (
            s_row["gpu"]["compute"] + s_row["gpu"]["comm_overlap"],
            _mean([o["gpu"]["compute"] + o["gpu"]["comm_overlap"] if o["gpu"] else 0.0 for o in others]),
        )
    cat = max(cats, key=lambda k: cats[k][0] - cats[k][1])
    mine, theirs = cats[cat]
    if cat == "cpu:outside_ops":
        name = _top_excess(s, rest, "python_outside", n_steps)
        cause = "data loading" if name and _DATA_LOADING.search(name[0]) else "input pipeline"
        if name:
            return f" ({cause}, outside operators: {short_function(name[0])} {name[1]:.1f} ms/step)", cause
        hint = "data loading, Python; trace with --with-stack to name the function"
        return f" (outside operators {mine:.1f} ms vs {theirs:.1f}: {hint})", cause
    if cat == "cpu:ops":
        name = _top_excess(s, rest, "ops", n_steps)
        op = name[0] if name else ""
        if _DATA_LOADING.search(op):
            cause = "data loading"
        elif _H2D_OPS.match(op):
            cause = "host-to-device copy"
        elif _LAUNCH_OPS.match(op) and s_row["gpu"] is not None:
            cause = "host launch"
        else:
            cause = "CPU operators"
        detail = f": {op[:80]} {name[1]:.1f} ms/step" if name else ""
        if cause == "host launch":
            mine_k = sum(int(v[0]) for v in s["kernels"].values()) / n_steps
            theirs_k = _mean([sum(int(v[0]) for v in r["kernels"].values()) / n_steps for r in rest])
            detail += f"; {mine_k:.0f} kernels/step vs {theirs_k:.0f}"
        return f" ({cause}, CPU operators {mine:.1f} vs {theirs:.1f} ms{detail})", cause
    if cat == "gpu:compute":
        name = _top_excess(s, rest, "kernels", n_steps)
        return (
            f" (GPU compute {mine:.1f} vs {theirs:.1f} ms{f'; most in {name[0][:80]}' if name else ''})",
            "GPU compute",
        )
    return f" (host-to-device copy: GPU memory copies {mine:.1f} vs {theirs:.1f} ms)", "host-to-device copy"


def _top_excess(s: dict[str, Any], rest: list[dict[str, Any]], key: str, n_steps: int) -> tuple[str, float] | None:
    """The name whose time per step grew most over the other ranks' mean. For Python functions,
    among names within 5 % of the largest excess, the one with the shortest mean frame (the
    innermost of nested frames holding the same time: ``load_batch`` rather than ``train``)."""
    col = 0 if key == "python_outside" else 1
    excess: dict[str, float] = {}
    for name, v in s[key].items():
        theirs = _mean([float(r[key][name][col]) if name in r[key] else 0.0 for r in rest])
        excess[name] = (float(v[col]) - theirs) / n_steps
    if not excess:
        return None
    best = max(excess.values())
    if best <= 0:
        return None
    if key != "python_outside":
        name = max(excess, key=excess.__getitem__)
        return name, excess[name]
    near = [n for n, v in excess.items() if v >= 0.95 * best]
    name = min(near, key=lambda n: s[key][n][1] / max(1, s[key][n][2]))
    return name, excess[name]


def _top_collective(rest: list[dict[str, Any]]) -> str:
    totals: dict[str, float] = defaultdict(float)
    for r in rest:
        for name, ms in r["collectives"].items():
            totals[short_collective(name)] += ms
    if not totals:
        return ""
    return max(totals, key=totals.__getitem__)


def _pick_timeline(ok: list[dict[str, Any]], common: list[int]) -> dict[str, Any] | None:
    """One step's timeline per rank: the common step whose slowest rank is the median."""
    candidates = [n for n in common if all(str(n) in r["timeline"] for r in ok)]
    if not candidates:
        return None
    slowest = {n: max(r["timeline"][str(n)]["step_ms"] for r in ok) for n in candidates}
    ordered = sorted(candidates, key=slowest.__getitem__)
    step = ordered[len(ordered) // 2]
    return {
        "step": step,
        "ranks": [{"rank": r["rank"], **r["timeline"][str(step)]} for r in ok],
    }


# -- comparison ---------------------------------------------------------------------------------
def category_means(analysis: dict[str, Any]) -> dict[str, float]:
    """Mean over ranks of each per-step figure: ``step_ms``, ``cpu.*``, ``gpu.*``."""
    ranks = analysis.get("ranks") or []
    out: dict[str, float] = {"step_ms": _mean([float(r["step_ms"]) for r in ranks])}
    for k in CPU_CATEGORIES:
        out["cpu." + k] = _mean([float(r["cpu"][k]) for r in ranks])
    gpu_ranks = [r for r in ranks if r.get("gpu")]
    if gpu_ranks:
        for k in GPU_CATEGORIES:
            out["gpu." + k] = _mean([float(r["gpu"][k]) for r in gpu_ranks])
    return out


def compare(a: dict[str, Any], b: dict[str, Any], top: int = 10) -> dict[str, Any]:
    """Per-category deltas (B - A, ms per step, mean over ranks) and the kernels and
    operators whose time per step and rank moved most."""
    ma, mb = category_means(a), category_means(b)
    cats = []
    for k in [*ma, *(k for k in mb if k not in ma)]:
        va, vb = ma.get(k), mb.get(k)
        delta = None if va is None or vb is None else vb - va
        pct = None if delta is None or not va else 100 * delta / va
        cats.append(
            {
                "category": k,
                "a_ms": None if va is None else _r(va),
                "b_ms": None if vb is None else _r(vb),
                "delta_ms": None if delta is None else _r(delta),
                "delta_pct": None if pct is None else _r(pct, 1),
            }
        )

    def moved(key: str) -> list[dict[str, Any]]:
        ra = {r["name"]: float(r["ms_per_step_per_rank"]) for r in a.get(key, [])}
        rb = {r["name"]: float(r["ms_per_step_per_rank"]) for r in b.get(key, [])}
        rows = [
            {
                "name": n,
                "a_ms": _r(ra.get(n, 0.0)),
                "b_ms": _r(rb.get(n, 0.0)),
                "delta_ms": _r(rb.get(n, 0.0) - ra.get(n, 0.0)),
            }
            for n in set(ra) | set(rb)
        ]
        rows.sort(key=lambda r: (-abs(r["delta_ms"]), r["name"]))  # equal moves: by name, the same every run
        return rows[:top]

    return {
        "schema": SCHEMA + ".compare",
        "schema_version": SCHEMA_VERSION,
        "categories": cats,
        "kernels": moved("top_kernels"),
        "ops": moved("top_ops"),
        "straggler": {"a": a.get("straggler"), "b": b.get("straggler")},
    }
