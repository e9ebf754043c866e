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
    where, cause, measured = _explain(s, rest, s_row, others, n_steps)
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
            **measured,
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
# The CUDA (or HIP) runtime's and driver's calls, as the trace names them: a kernel launch, a copy.
_LAUNCH_CALLS = re.compile(r"^(cuda|cu|hip)(LaunchKernel|LaunchCooperativeKernel|LaunchKernelEx|GraphLaunch)")
_COPY_CALLS = re.compile(r"^(cuda|cu|hip)Memcpy")
# A rank launches "far more" kernels than its peers when it launches this many times as many, and
# at least LAUNCH_MORE_MIN more per step: a launch then costs its host for its own launches' sake.
LAUNCH_RATIO = 2.0
LAUNCH_MORE_MIN = 20.0
# A rank copies more than its peers when its bytes per step exceed theirs by this share and at least
# COPY_MORE_MIN_BYTES: only then is its copy calls' extra time copying; else it waits in them.
COPY_MORE_FRACTION = 0.10
COPY_MORE_MIN_BYTES = 1 << 20
CAUSE_CLASSES = ("GPU compute", "host launch", "host-to-device copy", "data loading", "input pipeline", "CPU operators")


def _per_step(r: dict[str, Any], key: str, pattern: re.Pattern[str], n_steps: int) -> float:
    """ms per step a rank spends in the CPU calls whose names match ``pattern`` (self time)."""
    return sum(float(v[1]) for name, v in r[key].items() if pattern.match(name)) / n_steps


def cause_of(
    s: dict[str, Any], rest: list[dict[str, Any]], s_row: dict[str, Any], others: list[dict[str, Any]], n_steps: int
) -> tuple[str, dict[str, float], dict[str, float]]:
    """The straggler's cause class, from what its trace measures over its peers' mean (ms per step):

    * ``GPU compute``: its own kernels' extra time on the GPU (compute, overlapped or not);
    * ``host launch``: its extra time in kernel launch calls, and in the operators that issue
      them, when it launches far more kernels per step than its peers (:data:`LAUNCH_RATIO`): the
      launches are its own work. With as many kernels as its peers, a launch that takes longer
      waits for a full queue: it is waiting;
    * ``host-to-device copy``: the GPU's extra time copying, or its copy calls' extra time when it
      copies more bytes per step than its peers; a copy call that takes longer for no more bytes
      waits for the kernels queued before it: waiting, not copying;
    * ``data loading`` / ``input pipeline``: its extra time outside operators (Python, a loader);
    * ``CPU operators``: its CPU operators' extra time that is neither launching nor copying.

    The class is the largest of these; the waiting the launches and copies hold is measured
    beside them (``waiting``), never a cause of its own. Returns (class, measures, figures)."""
    gpu = s_row["gpu"] is not None

    def exc(of: Callable[[dict[str, Any]], float], mine: dict[str, Any], theirs: list[dict[str, Any]]) -> float:
        return of(mine) - _mean([of(o) for o in theirs])

    launch_exc = exc(lambda r: _per_step(r, "ops", _LAUNCH_CALLS, n_steps), s, rest)
    copy_exc = exc(lambda r: _per_step(r, "ops", _COPY_CALLS, n_steps), s, rest)
    my_k, _, _, my_bytes = _work_per_step(s)
    their_k = _mean([_work_per_step(r)[0] for r in rest])
    their_bytes = _mean([_work_per_step(r)[3] for r in rest])
    launches_more = my_k >= LAUNCH_RATIO * their_k and my_k - their_k >= LAUNCH_MORE_MIN
    copies_more = my_bytes - their_bytes >= max(COPY_MORE_MIN_BYTES, COPY_MORE_FRACTION * their_bytes)
    launching = max(0.0, launch_exc) if launches_more else 0.0
    copying = max(0.0, copy_exc) if copies_more else 0.0
    waiting = max(0.0, launch_exc - launching) + max(0.0, copy_exc - copying)
    cpu_ops = exc(lambda r: float(r["cpu"]["ops"]), s_row, others) - max(0.0, launch_exc) - max(0.0, copy_exc)
    if launches_more and cpu_ops > 0:
        # Each kernel is issued by an operator on the host: a rank that launches far more kernels
        # than its peers spends its extra operator time issuing them (dispatch, then the launch
        # call), which is host launch work too (seen on an H100: 3000 tiny kernels a step, 17 ms
        # in the launch calls and 24 ms more in the operators around them).
        launching += cpu_ops
        cpu_ops = 0.0
    outside = exc(lambda r: float(r["cpu"]["outside_ops"]), s_row, others)
    measures: dict[str, float] = {"CPU operators": cpu_ops, "outside operators": outside}
    if gpu:
        compute = exc(
            lambda r: float(r["gpu"]["compute"] + r["gpu"]["comm_overlap"]) if r["gpu"] else 0.0, s_row, others
        )
        device_copy = exc(lambda r: float(r["gpu"]["memcpy"]) if r["gpu"] else 0.0, s_row, others)
        measures.update(
            {
                "GPU compute": compute,
                "host launch": launching,
                "host-to-device copy": max(device_copy, copying),
            }
        )
    top = max(measures, key=lambda k: measures[k])
    figures = {
        "kernels_per_step": round(my_k, 1),
        "peers_kernels_per_step": round(their_k, 1),
        "launch_ms": round(launch_exc, 3),
        "copy_call_ms": round(copy_exc, 3),
        "waiting_ms": round(waiting, 3),
    }
    rounded = {k: round(v, 3) for k, v in measures.items()}
    if top == "outside operators":
        name = _top_excess(s, rest, "python_outside", n_steps)
        return ("data loading" if name and _DATA_LOADING.search(name[0]) else "input pipeline"), rounded, figures
    if top == "CPU operators":  # a loader's own annotation (enumerate(DataLoader)...) is an operator too
        name = _top_excess(s, rest, "ops", n_steps)
        if name and _DATA_LOADING.search(name[0]):
            return "data loading", rounded, figures
    return top, rounded, figures


def _explain(
    s: dict[str, Any], rest: list[dict[str, Any]], s_row: dict[str, Any], others: list[dict[str, Any]], n_steps: int
) -> tuple[str, str, dict[str, Any]]:
    """What the straggler spends its extra time on: (text for the reason, cause class, the
    measures behind it), the class from :func:`cause_of`: the reason's words and the class are
    one computation."""
    cause, measures, figures = cause_of(s, rest, s_row, others, n_steps)
    evidence = {"cause_ms": measures, **figures}
    waits = (
        f"; {figures['waiting_ms']:.1f} ms/step more in launches and copies that wait for its own kernels"
        if figures["waiting_ms"] >= 0.1
        else ""
    )
    if cause in ("data loading", "input pipeline"):
        name = _top_excess(s, rest, "python_outside", n_steps)
        mine, theirs = s_row["cpu"]["outside_ops"], _mean([o["cpu"]["outside_ops"] for o in others])
        if name:
            return f" ({cause}, outside operators: {short_function(name[0])} {name[1]:.1f} ms/step)", cause, evidence
        if cause == "data loading":
            op = _top_excess(s, rest, "ops", n_steps)
            if op:
                return f" (data loading, CPU operators: {op[0][:80]} {op[1]:.1f} ms/step)", cause, evidence
        hint = "data loading, Python; trace with --with-stack to name the function"
        return f" (outside operators {mine:.1f} ms vs {theirs:.1f}: {hint})", cause, evidence
    if cause == "host launch":
        return (
            f" (host launch: kernel launches +{measures['host launch']:.1f} ms/step; "
            f"{figures['kernels_per_step']:.0f} kernels/step vs {figures['peers_kernels_per_step']:.0f}{waits})",
            cause,
            evidence,
        )
    if cause == "GPU compute":
        mine = s_row["gpu"]["compute"] + s_row["gpu"]["comm_overlap"]
        theirs = _mean([o["gpu"]["compute"] + o["gpu"]["comm_overlap"] if o["gpu"] else 0.0 for o in others])
        name = _top_excess(s, rest, "kernels", n_steps)
        most = f"; most in {name[0][:80]}" if name else ""
        return f" (GPU compute {mine:.1f} vs {theirs:.1f} ms{most}{waits})", cause, evidence
    if cause == "host-to-device copy":
        mine, theirs = s_row["gpu"]["memcpy"], _mean([o["gpu"]["memcpy"] if o["gpu"] else 0.0 for o in others])
        _, _, _, my_bytes = _work_per_step(s)
        their_bytes = _mean([_work_per_step(r)[3] for r in rest])
        return (
            f" (host-to-device copy: GPU memory copies {mine:.1f} vs {theirs:.1f} ms, "
            f"{_mib(my_bytes)} vs {_mib(their_bytes)} copied per step; copy calls +{figures['copy_call_ms']:.1f} ms)",
            cause,
            evidence,
        )
    op = _top_excess(s, rest, "ops", n_steps)
    detail = f": {op[0][:80]} {op[1]:.1f} ms/step" if op else ""
    mine, theirs = s_row["cpu"]["ops"], _mean([o["cpu"]["ops"] for o in others])
    return f" (CPU operators {mine:.1f} vs {theirs:.1f} ms{detail}{waits})", cause, evidence


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
