"""``stacks`` over many nodes, as it was before the stacks package merges it (a temporary home:
the stacks command's job-wide answer moves beside the stacks merge).

Each node's sidecar reads its ranks' stacks; the answers are grouped over all ranks, each
rank named with its node.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dynprof.cli import job
from dynprof.cli._common import print_json, printable_lines
from dynprof.cli.job import (
    Text,
    artifacts_of,
    envelope,
    exit_code,
    fetched_doc,
    forward_options,
    maybe_fetch,
    node_messages,
    with_fetch,
)
from dynprof.job.answers import as_list, int_or_none, node_labels, rank_key, rows
from dynprof.job.client import NodeAnswer
from dynprof.job.discovery import Node


# -- stacks --------------------------------------------------------------------------------------
def stacks(args: argparse.Namespace, nodes: list[Node]) -> int:
    from collectors import stacks as st

    client = job.client_for(args)
    answers = client.action_all(nodes, "stacks", forward_options("stacks", args), timeout=args.timeout + 5.0)
    for line in node_messages(answers):
        print(f"dynprof: {line}", file=sys.stderr)
    labels = node_labels(nodes)
    processes: list[Any] = []
    process_rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for a in answers:
        label = labels[a.node]
        if not a.answered:
            failures[f"node {label}"] = a.error or "no answer"
            continue
        if a.exit_code and not rows(a, "processes"):
            failures[f"node {label}"] = a.command_error() or f"exit code {a.exit_code}"
        result = a.result if isinstance(a.result, dict) else {}
        node_failures = result.get("failures")
        if isinstance(node_failures, dict):
            for who, why in list(node_failures.items())[:10_000]:
                failures[f"{who} on {label}"] = str(why)[:2000]
        group_frames = _frames_of_groups(a)
        for row in rows(a, "processes"):
            p = _process_from_row(row, label, group_frames)
            if p is None:
                continue
            processes.append(p)
            process_rows.append({**{k: row.get(k) for k in ("pid", "rank", "job", "host", "method")}, "node": label})
    groups = st.group_processes(processes, by_host=True)
    process_rows.sort(key=rank_key)
    artifacts = artifacts_of(answers, labels, lambda r: [r.get("artifact")])
    fetched = maybe_fetch(args, client, answers, artifacts)
    code = with_fetch(exit_code(answers), fetched)
    if args.json:
        print_json(
            {
                **envelope(answers),
                "groups": [_group_json(g, labels) for g in groups],
                "processes": process_rows,
                "failures": failures,
                "artifacts": artifacts,
                **fetched_doc(fetched),
            }
        )
        return code
    if processes:
        print(printable_lines(st.render_merged(processes, groups)), end="")
    else:
        print("no process read on any node")
    for who, why in failures.items():
        print(printable_lines(f"FAILED {who}: {why}"))
    if args.full:
        print("every process's full dump (all threads) is in its node's stacks artifact: --fetch DIR copies them here")
    text = Text()
    text.artifacts(artifacts, fetched)
    if text.value():
        print(text.value())
    print(f"\n{len(processes)} process(es) read on {sum(a.answered for a in answers)} of {len(nodes)} node(s)")
    return code


def _frames_of_groups(answer: NodeAnswer) -> dict[int, list[Any]]:
    """pid -> main-thread stack, from a node's own groups: what an answer whose processes do
    not carry their main thread (a dynprof before `main_thread`) still says."""
    out: dict[int, list[Any]] = {}
    for g in rows(answer, "groups"):
        frames = [_frame(f) for f in as_list(g.get("frames"))[:1024] if isinstance(f, dict)]
        for pid in as_list(g.get("pids")):
            if int_or_none(pid) is not None:
                out.setdefault(pid, frames)
    return out


def _process_from_row(row: dict[str, Any], label: str, group_frames: dict[int, list[Any]] | None = None) -> Any:
    from collectors.stacks import ProcessStacks, ThreadStack

    pid = int_or_none(row.get("pid"))
    main = row.get("main_thread")
    if pid is None:
        return None
    threads = []
    if isinstance(main, dict):
        frames = [_frame(f) for f in as_list(main.get("frames"))[:1024] if isinstance(f, dict)]
        holds = main.get("holds_gil")
        tid = int_or_none(main.get("tid")) or pid
        threads.append(
            ThreadStack(tid=tid, main=True, holds_gil=holds if isinstance(holds, bool) else None, frames=frames)
        )
    elif group_frames and pid in group_frames:
        threads.append(ThreadStack(tid=pid, main=True, frames=group_frames[pid]))
    method = row.get("method")
    return ProcessStacks(
        pid=pid,
        method=str(method)[:40] if method else "?",
        native=row.get("native") is True,
        rank=int_or_none(row.get("rank")),
        job=str(row["job"])[:200] if row.get("job") else None,
        host=label,
        threads=threads,
        fallback_reason=str(row["fallback_reason"])[:2000] if row.get("fallback_reason") else None,
    )


def _frame(d: dict[str, Any]) -> Any:
    """A frame from a node's answer, every field of the type the renderers expect."""
    from collectors.stacks import Frame

    def text(key: str, default: str = "") -> str:
        value = d.get(key)
        return value[:1000] if isinstance(value, str) else default

    library = d.get("library")
    return Frame(
        function=text("function", "?"),
        file=text("file"),
        line=int_or_none(d.get("line")) or 0,
        native=d.get("native") is True,
        library=library[:1000] if isinstance(library, str) else None,
    )


def _group_json(group: Any, labels: dict[Node, str]) -> dict[str, Any]:
    d: dict[str, Any] = group.to_dict()
    d["members"] = [{"rank": m.rank, "pid": m.pid, "node": m.host} for m in group.members]
    d["odd"] = [f"{m.label} on {m.host}" for m in group.members] if group.outlier else []
    return d
