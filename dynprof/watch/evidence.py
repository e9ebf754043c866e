"""What a look read, and what a verdict keeps of it: the stacks' groups, the flight recorder's
process groups, each node's healthcheck, each rank's row, and (with ``--gpu-coredump``) the
kernels the culprits' GPUs ran.

The engine (:mod:`dynprof.watch.engine`) gathers through its source; these functions shape what
it gathered into the verdict's ``evidence`` and ``ranks``, bounded, whatever a node sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from collectors.stacks import ProcessStacks, Stacks
from dynprof.watch.model import RankProgress
from dynprof.watch.stall import rank_age

if TYPE_CHECKING:  # for the annotations only
    from healthcheck.fleet import NodeReport

MAX_STACKS_EVIDENCE_GROUPS = 50


def healthcheck_summary(doc: Any) -> dict[str, Any]:
    """What a verdict keeps of a node's healthcheck report: its verdict and the checks that
    did not pass (Xid, ECC, clocks, NVLink, InfiniBand, ...)."""
    if not isinstance(doc, dict):
        return {"verdict": "unreadable", "problems": []}
    problems = []
    for check in doc.get("checks") or []:
        if isinstance(check, dict) and check.get("status") in ("fail", "warn", "unknown"):
            problems.append(
                {
                    "name": str(check.get("name"))[:100],
                    "status": str(check.get("status"))[:20],
                    "device": check.get("device") if isinstance(check.get("device"), (int, str)) else None,
                    "reason": str(check.get("reason") or "")[:300],
                }
            )
    return {
        "verdict": str(doc.get("verdict") or "?")[:40],
        "exit_code": doc.get("exit_code") if isinstance(doc.get("exit_code"), int) else None,
        "counts": doc.get("counts") if isinstance(doc.get("counts"), dict) else {},
        "problems": problems[:50],
    }


def report_summary(report: NodeReport) -> dict[str, Any]:
    """:func:`healthcheck_summary` of a report already decoded (this node's, as
    :func:`healthcheck.collect.collect` returns it): the same document."""
    from healthcheck.result import Status, verdict

    shown = (Status.FAIL, Status.WARN, Status.UNKNOWN)
    problems = [
        {"name": c.name[:100], "status": c.status.value[:20], "device": c.device, "reason": c.reason[:300]}
        for c in report.checks
        if c.status in shown
    ]
    return {
        "verdict": verdict(report.exit_code)[:40],
        "exit_code": report.exit_code,
        "counts": {s.value: sum(1 for c in report.checks if c.status is s) for s in Status},
        "problems": problems[:50],
    }


def by_process(stacks: Stacks) -> dict[tuple[str, int], ProcessStacks]:
    """A sample's processes by (node, pid)."""
    return {(p.host or "?", p.pid): p for p in stacks.processes}


def failure_of(failures: dict[str, str], node: str, row: RankProgress) -> str | None:
    """Why a rank's stacks were not read (its node's or its own failure), if they were not."""
    for who, why in failures.items():
        if who == f"node {node}" or (f"pid {row.pid}" in who and node in who):
            return why[:300]
    return None


def rank_row(node: str, r: RankProgress) -> dict[str, Any]:
    """A rank's row in a verdict that did not look (progress resumed, ``--once`` on a job that moves)."""
    return {
        "rank": r.rank,
        "host": node,
        "pid": r.pid,
        "step": r.step,
        "last_step_age_s": None if rank_age(r) is None else round(rank_age(r) or 0.0, 3),
        "state": "stepping" if r.agent == "up" else r.agent,
    }


def name_kernels_of(
    take: Callable[[str, int], dict[str, Any]],
    dumps: dict[tuple[str, int], dict[str, Any]],
    items: list[dict[str, Any]],
    waiting_gpu: set[tuple[str, int]] | frozenset[Any] = frozenset(),
) -> None:
    """With ``--gpu-coredump``: dump the GPU of each culprit whose driver is armed and that waits
    for its GPU (``waiting_gpu``: (node, pid) of the ranks in a blocking CUDA call) or whose step's
    GPU work has not finished, once per process (``dumps``: (node, pid) -> what its dump named,
    the watch's), with ``take(node, pid)`` (its source's
    :meth:`~dynprof.watch.sources.WatchSource.gpu_coredump`), and put the kernels it ran into its
    ``gpu`` evidence (``kernel``, ``coredump``) and its line."""
    for item in items:
        step = item.get("gpu_step") or {}
        pid = item.get("pid")
        if not isinstance(pid, int) or not step.get("coredump_armed"):
            continue
        key = (str(item.get("host")), pid)
        if step.get("done") is not False and key not in waiting_gpu:
            continue  # its GPU finished what it was given and the rank does not wait for it
        found = dumps.get(key)
        if found is None:
            found = take(str(item.get("host")), pid)
            dumps[key] = found
        item["kernel"] = found["kernel"]
        if found.get("coredump"):
            item["coredump"] = found["coredump"]
            item["line"] = f"{item.get('line')}; its GPU ran {found['kernel'].removeprefix('running ')}"


def stacks_evidence(stacks: Stacks) -> dict[str, Any]:
    """What a verdict keeps of the merged stacks: the groups (who, where), not every frame."""
    groups = []
    for g in stacks.groups[:MAX_STACKS_EVIDENCE_GROUPS]:
        groups.append(
            {
                "label": g.labels[:2000],
                "size": len(g.members),
                "outlier": g.outlier,
                "headline": g.headline()[:2000],
                "members": [{"rank": m.rank, "host": m.host, "pid": m.pid} for m in g.members[:1000]],
            }
        )
    return {
        "groups": groups,
        "failures": dict(list(stacks.failures.items())[:100]),
        "processes": len(stacks.processes),
        "file": "stacks.json",
    }


def fr_summary(analysis: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """What a verdict keeps of the flight recorder's analysis: each process group's finding."""
    if not isinstance(analysis, dict):
        return None
    out = []
    for pg in analysis.get("process_groups") or []:
        if isinstance(pg, dict):
            out.append({k: pg.get(k) for k in ("process_group", "collective", "waiting", "missing", "hung", "verdict")})
    return out[:64]
