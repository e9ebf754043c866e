"""Job-level commands over many nodes: each node's sidecar runs the command, the answers merge.

``ps``, ``start``, ``stop``, ``stacks``, ``memory``, ``nccl`` and ``ls`` take ``--hosts`` /
``--hostfile`` (and whatever :func:`dynprof.job.discovery.resolve_nodes` finds). When nodes are
named, the command sends its own options to every node's sidecar as the action of the same
name (one level only: never the node options themselves) and merges the answers:

    {"nodes": [{"node": "node-5:8787", "host": "node-5", "ok": true, "error": null, "exit_code": 0, ...}],
     "per_node": {"node-5:8787": <that node's `--json` output>, ...},
     <a top-level list over all nodes: "agents", "groups", "results", "artifacts", ...>}

A node that does not answer is named in ``nodes`` and on stderr with its reason; the others
are still merged. Exit code: 12 when some node did not answer, else the highest exit code of
the nodes' commands (0 when every node succeeded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dynprof import errors, roles
from dynprof.cli._common import (
    Progress,
    human_age,
    human_bytes,
    print_json,
    printable,
    printable_lines,
    table,
)
from dynprof.job.client import (
    NodeAnswer,
    NodeFailure,
    SidecarClient,
    check_artifact_id,
    check_file_name,
    tls_context,
)
from dynprof.job.discovery import Node
from dynprof.sidecar.actions import ACTIONS
from dynprof.tokens import read_token_file
from dynprof.untrusted import loads_json

NODES_FAILED_EXIT = errors.NodesFailed.exit_code
FETCH_TIMEOUT_S = 600.0


def client_for(args: argparse.Namespace) -> SidecarClient:
    path = args.token_file or os.environ.get("DYNPROF_TOKEN_FILE") or None
    if not path:
        raise errors.UsageError(
            "the sidecars need their access token",
            help="Give --token-file FILE (mode 0600) or set DYNPROF_TOKEN_FILE, as for `dynprof serve`.",
        )
    token = read_token_file(path)
    tls = tls_context(args.cacert) if args.cacert else None
    return SidecarClient(token, tls=tls, timeout=args.node_timeout, max_in_flight=args.max_in_flight)


def forward_options(name: str, args: argparse.Namespace, **override: Any) -> dict[str, Any]:
    """The command's own options, as action ``name`` takes them (unset ones left out)."""
    out: dict[str, Any] = {}
    for key in ACTIONS[name].options:
        value = override[key] if key in override else getattr(args, key, None)
        if value is None or value is False or value == []:
            continue
        out[key] = value
    return out


def node_labels(nodes: list[Node]) -> dict[Node, str]:
    """How output names a node: its host, or host:port where several nodes share a host."""
    counts = Counter(n.host for n in nodes)
    return {n: (n.host if counts[n.host] == 1 else n.address) for n in nodes}


def exit_code(answers: list[NodeAnswer]) -> int:
    if any(not a.answered for a in answers):
        return NODES_FAILED_EXIT
    return max((a.exit_code or 0 for a in answers), default=0)


MAX_MESSAGES_SHOWN = 20


def report_nodes(answers: list[NodeAnswer]) -> None:
    """On stderr: why each node did not answer, and what each node's command said there
    (its warnings and errors, with their `what to do`)."""
    for a in answers:
        if not a.answered:
            print(f"dynprof: node {a.node}: {printable(a.error)}", file=sys.stderr)
            continue
        for line in a.messages[:MAX_MESSAGES_SHOWN]:
            print(f"dynprof: node {a.node}: {printable(line.removeprefix('dynprof: '))}", file=sys.stderr)
        if len(a.messages) > MAX_MESSAGES_SHOWN:
            print(f"dynprof: node {a.node}: ... {len(a.messages) - MAX_MESSAGES_SHOWN} more line(s)", file=sys.stderr)
        if a.exit_code and not a.messages:
            print(f"dynprof: node {a.node}: exit {a.exit_code}", file=sys.stderr)


def envelope(answers: list[NodeAnswer], strip: tuple[str, ...] = ()) -> dict[str, Any]:
    per_node: dict[str, Any] = {}
    for a in answers:
        result = a.result
        if strip and isinstance(result, dict):
            result = {k: v for k, v in result.items() if k not in strip}
        per_node[a.node.address] = result
    return {"nodes": [a.summary(a.node.address) for a in answers], "per_node": per_node}


def _rows(answer: NodeAnswer, key: str) -> list[dict[str, Any]]:
    """The list ``key`` of a node's result, keeping only objects (the answer is untrusted)."""
    if not answer.answered or not isinstance(answer.result, dict):
        return []
    rows = answer.result.get(key)
    if not isinstance(rows, list):
        return []
    return [dict(r) for r in rows if isinstance(r, dict)]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rank_key(row: dict[str, Any]) -> tuple[str, int, str, int]:
    rank = _int_or_none(row.get("rank"))
    pid = _int_or_none(row.get("pid"))
    return (str(row.get("job") or ""), rank if rank is not None else 1 << 30, str(row.get("node")), pid or 0)


def _with_fetch(code: int, fetched: list[dict[str, Any]] | None) -> int:
    """An artifact that could not be fetched makes a command that otherwise succeeded exit 1."""
    return 1 if code == 0 and fetched and any(f["error"] for f in fetched) else code


def _footer(answers: list[NodeAnswer]) -> None:
    failed = [a for a in answers if not a.answered]
    if failed:
        print(f"\n{len(failed)} of {len(answers)} node(s) did not answer:")
        for a in failed:
            print(f"  {a.node}: {printable(a.error)}")


# -- ps ------------------------------------------------------------------------------------------
def ps(args: argparse.Namespace, nodes: list[Node]) -> int:
    client = client_for(args)
    answers = client.action_all(nodes, "ps", forward_options("ps", args), timeout=args.timeout + 1.0)
    report_nodes(answers)
    labels = node_labels(nodes)
    rows = []
    for a in answers:
        for row in _rows(a, "agents"):
            row["node"] = labels[a.node]
            rows.append(row)
    rows.sort(key=_rank_key)
    code = exit_code(answers)
    if args.json:
        print_json({**envelope(answers, strip=("agents",)), "agents": rows})
        return code
    print(
        table(
            [
                (
                    r.get("node"),
                    r.get("rank") if r.get("rank") is not None else "-",
                    r.get("pid"),
                    r.get("role") or "-",
                    r.get("job") or "-",
                    r.get("step") if r.get("step") is not None else "-",
                    r.get("state"),
                    human_age(float(r.get("age_s") or 0)) if isinstance(r.get("age_s"), (int, float)) else "-",
                    " ".join(str(c) for c in _list(r.get("cmdline")))[:50],
                )
                for r in rows
            ],
            ["NODE", "RANK", "PID", "ROLE", "JOB", "STEP", "STATE", "AGE", "COMMAND"],
        )
    )
    print(f"\n{len(rows)} agent(s) on {sum(a.answered for a in answers)} node(s)")
    _footer(answers)
    return code


# -- nccl ----------------------------------------------------------------------------------------
def nccl(args: argparse.Namespace, nodes: list[Node]) -> int:
    """Each node dumps its ranks' flight recorders into one artifact; every rank's dump is read
    back from those artifacts (through the sidecars, checked against their manifests) and all
    are analysed together."""
    from collectors import flight_recorder as fr

    client = client_for(args)
    answers = client.action_all(nodes, "nccl", forward_options("nccl", args), timeout=args.timeout + 5.0)
    report_nodes(answers)
    labels = node_labels(nodes)
    notes: list[str] = []
    for a in answers:
        result = a.result if isinstance(a.result, dict) else {}
        notes.extend(f"{labels[a.node]}: {str(n)[:2000]}" for n in _list(result.get("notes")))
    ids = _artifact_ids(client, args, answers, "nccl")
    per_rank: dict[int, dict[str, Any]] = {}
    where: dict[int, str] = {}
    readable: list[tuple[NodeAnswer, str]] = []
    for a in answers:
        artifact_id = ids.get(a.node.address)
        if isinstance(artifact_id, NodeFailure):
            notes.append(f"{labels[a.node]}: its dumps cannot be read: {artifact_id.reason}")
        elif artifact_id is not None:
            readable.append((a, artifact_id))
    # Each node's dumps are read in turn; the nodes in parallel. Notes are kept per node, in node order.
    node_notes: list[list[str]] = [[] for _ in readable]

    def read(i: int) -> list[tuple[int, dict[str, Any]]]:
        a, artifact_id = readable[i]
        return _dumps_of(client, a.node, artifact_id, node_notes[i], labels[a.node])

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(client.max_in_flight, len(readable)))) as pool:
        dumps = list(pool.map(read, range(len(readable))))
    for (a, _), found, more in zip(readable, dumps, node_notes):
        label = labels[a.node]
        notes.extend(more)
        for rank, doc in found:
            if rank in per_rank:
                notes.append(f"rank {rank} dumped on {where[rank]} and on {label}: the one of {where[rank]} kept")
                continue
            per_rank[rank], where[rank] = doc, label
    analysis: dict[str, Any] | None = None
    if per_rank:
        try:
            analysis = fr.analyze(per_rank)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            notes.append(f"the dumps could not be analysed together: {type(exc).__name__}: {exc}")
    artifacts = _artifacts_of(answers, labels, lambda r: [r.get("artifact")])
    fetched = _maybe_fetch(args, client, answers, artifacts)
    code = _with_fetch(exit_code(answers), fetched)
    if analysis is None and code == 0:
        code = 1
    if args.json:
        print_json(
            {
                **envelope(answers),
                "analysis": analysis,
                "ranks": {str(r): where[r] for r in sorted(per_rank)},
                "notes": notes,
                "artifacts": artifacts,
                **({"fetched": fetched} if fetched is not None else {}),
            }
        )
        return code
    if analysis is not None:
        print(printable_lines(fr.render_analysis(analysis)), end="")
    for n in notes:
        print(printable_lines(f"note: {n}"))
    _print_artifacts(artifacts, fetched)
    print(f"{len(per_rank)} rank(s) dumped on {sum(a.answered for a in answers)} of {len(nodes)} node(s)")
    _footer(answers)
    return code


_DUMP_FILE = re.compile(r"rank(\d{1,9})-pid\d{1,9}\.json")
MAX_DUMP_BYTES = 512 * 1024 * 1024


def _artifact_ids(
    client: SidecarClient, args: argparse.Namespace, answers: list[NodeAnswer], action: str
) -> dict[str, str | NodeFailure]:
    """Per node address, the id of the artifact its answer names (``artifact_id``; else its
    ``artifact`` path looked up in the node's store listing), or why there is none."""
    out: dict[str, str | NodeFailure] = {}
    by_path: dict[str, str] = {}
    for a in answers:
        if not a.answered or not isinstance(a.result, dict):
            continue
        given, path = a.result.get("artifact_id"), a.result.get("artifact")
        if given is not None:
            try:
                out[a.node.address] = check_artifact_id(given)
            except NodeFailure as exc:
                out[a.node.address] = exc
        elif isinstance(path, str) and path:
            by_path[a.node.address] = path
    if by_path:
        job = getattr(args, "job", None)
        nodes = [a.node for a in answers if a.node.address in by_path]
        for listing in client.action_all(nodes, "ls", {"job": job, "kind": action} if job else {"kind": action}, 30.0):
            found = {r.get("path"): r.get("id") for r in _rows(listing, "artifacts")}
            path = by_path[listing.node.address]
            if path in found:
                try:
                    out[listing.node.address] = check_artifact_id(found[path])
                except NodeFailure as exc:
                    out[listing.node.address] = exc
            else:
                out[listing.node.address] = NodeFailure(listing.error or f"{path} is not in the node's store listing")
    return out


def _dumps_of(
    client: SidecarClient, node: Node, artifact_id: str, notes: list[str], label: str
) -> list[tuple[int, dict[str, Any]]]:
    """The ranks' dumps (``rank<R>-pid<P>.json``) of one node's nccl artifact."""
    try:
        files = _manifest_files(client.artifact(node, artifact_id)["manifest"])
    except NodeFailure as exc:
        notes.append(f"{label}: its dumps cannot be read: {exc.reason}")
        return []
    out = []
    for name, size, sha in files:
        match = _DUMP_FILE.fullmatch(name)
        if match is None:
            continue
        try:
            data = client.read_file(node, artifact_id, name, size, sha, FETCH_TIMEOUT_S, MAX_DUMP_BYTES)
            doc = loads_json(data, f"{name} of {label}")
        except NodeFailure as exc:
            notes.append(f"{label}: {exc.reason}")
            continue
        except errors.ArtifactError as exc:
            notes.append(f"{label}: {exc.message}")
            continue
        if isinstance(doc, dict):
            out.append((int(match.group(1)), doc))
    return out


def _manifest_files(manifest: Any) -> list[tuple[str, int, str]]:
    """(name, size, sha256) of each file a manifest lists, each checked; NodeFailure otherwise."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or len(files) > 10_000:
        raise NodeFailure("its manifest has no list of files")
    checked = []
    for f in files:
        if not isinstance(f, dict):
            raise NodeFailure("its manifest lists a file that is not an object")
        name = check_file_name(f.get("name"))
        size, sha = f.get("size"), f.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(sha, str):
            raise NodeFailure(f"its manifest gives no size or sha256 for {name}")
        checked.append((name, size, sha.lower()))
    return checked


# -- stop, memory: plain fan-out ---------------------------------------------------------------
def plain(name: str, args: argparse.Namespace, nodes: list[Node]) -> int:
    client = client_for(args)
    wait = getattr(args, "timeout", None) or ACTIONS[name].default_timeout_s
    answers = client.action_all(nodes, name, forward_options(name, args), timeout=wait + 5.0)

    def line(r: dict[str, Any]) -> str:
        detail = r.get("artifact") or r.get("memory_history") or r.get("error") or ""
        return f"{r.get('status')}: {detail}".rstrip(": ")

    return _report_per_rank(args, client, nodes, answers, ("results",), line)


def _report_per_rank(
    args: argparse.Namespace,
    client: SidecarClient,
    nodes: list[Node],
    answers: list[NodeAnswer],
    keys: tuple[str, ...],
    line: Any,
) -> int:
    """The nodes' per-rank rows (under the first of ``keys`` a node's answer has), merged in
    rank order with their node: JSON, or one ``rank R on NODE: line(row)`` each."""
    report_nodes(answers)
    labels = node_labels(nodes)
    results = []
    for a in answers:
        for row in next((rows for rows in (_rows(a, k) for k in keys) if rows), []):
            row["node"] = labels[a.node]
            results.append(row)
    results.sort(key=_rank_key)
    artifacts = _artifacts_of(answers, labels, lambda r: [x.get("artifact") for x in _rows_of(r, "results")])
    fetched = _maybe_fetch(args, client, answers, artifacts)
    code = _with_fetch(exit_code(answers), fetched)
    if args.json:
        print_json(
            {
                **envelope(answers, strip=keys),
                "results": results,
                "artifacts": artifacts,
                **({"fetched": fetched} if fetched is not None else {}),
            }
        )
        return code
    for r in results:
        who = f"rank {r.get('rank')}" if r.get("rank") is not None else f"pid {r.get('pid')}"
        print(printable(f"{who} on {r['node']}: {line(r)}"))
    _print_artifacts([], fetched)
    _footer(answers)
    return code


def _rows_of(result: Any, key: str) -> list[dict[str, Any]]:
    rows = result.get(key) if isinstance(result, dict) else None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


# -- ls ------------------------------------------------------------------------------------------
def ls(args: argparse.Namespace, nodes: list[Node]) -> int:
    client = client_for(args)
    answers = client.action_all(nodes, "ls", forward_options("ls", args), timeout=30.0)
    report_nodes(answers)
    labels = node_labels(nodes)
    found: list[tuple[Node, dict[str, Any]]] = []
    for a in answers:
        for row in _rows(a, "artifacts"):
            row["node"] = labels[a.node]
            found.append((a.node, row))
    found.sort(key=lambda nr: str(nr[1].get("created_at") or ""), reverse=True)
    if args.limit:
        found = found[: args.limit]  # each node kept its newest; the newest of all remain
    rows = [row for _, row in found]
    fetched = fetch(client, Path(args.fetch), [(n, row.get("id")) for n, row in found]) if args.fetch else None
    code = _with_fetch(exit_code(answers), fetched)
    if args.json:
        print_json(
            {
                **envelope(answers, strip=("artifacts",)),
                "artifacts": rows,
                **({"fetched": fetched} if fetched is not None else {}),
            }
        )
        return code
    print(
        table(
            [
                (
                    r["node"],
                    r.get("id"),
                    r.get("kind"),
                    r.get("status"),
                    r.get("rank") if r.get("rank") is not None else "-",
                    r.get("created_at"),
                    human_bytes(r["bytes"]) if isinstance(r.get("bytes"), int) else "-",
                )
                for r in rows
            ],
            ["NODE", "ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"],
        )
    )
    print(f"\n{len(rows)} artifact(s) on {sum(a.answered for a in answers)} node(s)")
    _print_artifacts([], fetched)
    _footer(answers)
    return code


# -- start: one step for every rank of every node ---------------------------------------------
# How far ahead the common start step is put: the fan-out round trip (ps, then start) is
# measured, doubled, and added to the single-node lead; each retry after a node found the
# step already passed puts it four times further.
START_LEAD_MIN_S = 1.0
START_WAIT_DEFAULT_S = 600.0
START_ARM_TIMEOUT_S = 30.0
START_POLL_S = 0.5
START_SILENCE_MIN_S = 30.0


def start(args: argparse.Namespace, nodes: list[Node]) -> int:
    """Steps mode: read every rank's step (ps on every node), pick the smallest step every rank
    still reaches, arm every node at it (``start --no-wait --at-step S``), retry further ahead
    when a node finds it passed, then follow the traces (ps) until each rank's is written.
    Duration and open-ended traces go to every node as they are."""
    from dynprof.cli.start import ALIGN_LEAD_S, ALIGN_RETRIES, alignment_step

    if not args.job and not args.all:
        raise errors.UsageError("with --hosts, select the ranks with --job JOB (or --all)")
    if args.duration is not None and args.at_step is not None:
        raise errors.UsageError("--at-step applies to step mode, not to --duration")
    client = client_for(args)
    if not args.steps:
        return _start_as_is(args, client, nodes)
    labels = node_labels(nodes)
    progress = Progress(enabled=not args.json)
    lead, rtt, stepping = START_LEAD_MIN_S, 0.0, []
    at_step = args.at_step
    attempts: list[dict[str, Any]] = []
    arm: list[NodeAnswer] = []
    for attempt in range(ALIGN_RETRIES):
        if args.at_step is None:
            t0 = time.monotonic()
            stepping = _steps_of(client, args, nodes, labels)
            rtt = max(rtt, time.monotonic() - t0)
            if not stepping:
                print("dynprof: no rank of the job has stepped an optimizer yet on any node", file=sys.stderr)
                at_step = None
            else:
                if attempt == 0:
                    lead = max(START_LEAD_MIN_S, ALIGN_LEAD_S + 2.0 * rtt)
                statuses = [SimpleNamespace(step=r["step"], step_time_s=r["step_time_s"]) for r in stepping]
                at_step = alignment_step(statuses, lead)
        progress.update(f"arming {len(nodes)} node(s) at step {at_step}")
        t0 = time.monotonic()
        options = forward_options("start", args, at_step=at_step, no_wait=True, timeout=START_ARM_TIMEOUT_S)
        arm = client.action_all(nodes, "start", options, timeout=START_ARM_TIMEOUT_S)
        rtt = max(rtt, time.monotonic() - t0)
        failed = [a for a in arm if not a.ok]
        attempts.append({"at_step": at_step, "lead_s": round(lead, 3), "failed_nodes": [str(a.node) for a in failed]})
        if not failed or args.at_step is not None or at_step is None or attempt + 1 == ALIGN_RETRIES:
            break
        # Did a failed node find the step already passed? Its ranks' steps say so.
        failed_labels = {labels[a.node] for a in failed if a.answered}
        stepping = _steps_of(client, args, nodes, labels)
        if not any(r["node"] in failed_labels and r["step"] >= at_step for r in stepping):
            break
        armed = [a.node for a in arm if a.ok]
        progress.update(f"step {at_step} passed on some node: cancelling and arming further ahead")
        client.action_all(armed, "stop", {"job": args.job, "all": args.all, "no_wait": True}, timeout=30.0)
        lead *= 4
    report_nodes(arm)
    before = {(r["node"], r["pid"]): r["last_artifact"] for r in stepping}
    results, missed = _follow_traces(args, client, nodes, labels, arm, at_step, progress, before)
    for a in arm:
        if a.ok:
            continue
        why = a.error if not a.answered else a.command_error() or "no trace started"
        ranks = [r for r in stepping if r["node"] == labels[a.node]] or [{"rank": None, "pid": None}]
        missed.extend({"rank": r["rank"], "pid": r["pid"], "node": labels[a.node], "reason": why} for r in ranks)
    missed.sort(key=_rank_key)
    address = {labels[n]: n.address for n in nodes}
    artifacts = [
        {"node": r["node"], "node_address": address[r["node"]], "path": r["artifact"]}
        for r in results
        if isinstance(r.get("artifact"), str) and r["artifact"]
    ]
    fetched = _maybe_fetch(args, client, arm, artifacts)
    code = _with_fetch(exit_code(arm), fetched)
    if missed and code == 0:
        code = 1
    plan = {"lead_s": round(lead, 3), "round_trip_s": round(rtt, 3), "attempts": attempts}
    if args.json:
        print_json(
            {
                **envelope(arm, strip=("targets",)),
                "at_step": at_step,
                "plan": plan,
                "results": results,
                "missed": missed,
                "artifacts": artifacts,
                **({"fetched": fetched} if fetched is not None else {}),
            }
        )
        return code
    where = f"step {at_step}" if at_step else "each node's next step boundary"
    print(f"trace of {args.steps} steps on {len(results)} rank(s) of {len(nodes)} node(s), starting after {where}")
    for r in results:
        who = f"rank {r.get('rank')}" if r.get("rank") is not None else f"pid {r.get('pid')}"
        detail = r.get("artifact") or r.get("error") or ""
        print(printable(f"{who} on {r['node']}: from step {r.get('start_step')}: {r.get('status')}: {detail}"))
    for m in missed:
        who = f"rank {m['rank']}" if m.get("rank") is not None else "ranks"
        print(printable(f"MISSED {who} on {m['node']}: {m['reason']}"))
    _print_artifacts([], fetched)
    _footer(arm)
    return code


def _steps_of(
    client: SidecarClient, args: argparse.Namespace, nodes: list[Node], labels: dict[Node, str]
) -> list[dict[str, Any]]:
    """Every rank of the job that has stepped, on every node that answers: step and step time."""
    out = []
    for a in client.action_all(nodes, "ps", forward_options("ps", args, timeout=2.0), timeout=3.0):
        for row in _rows(a, "agents"):
            if args.job and row.get("job") != args.job:
                continue
            step = _int_or_none(row.get("step"))
            if step is None or step <= 0 or row.get("state") in ("error", "unresponsive"):
                continue
            if row.get("role") not in (None, roles.TRAINER):  # a launcher's or worker's agent never leads
                continue
            ms = row.get("step_time_ms")
            seconds_ = ms / 1000.0 if isinstance(ms, (int, float)) and not isinstance(ms, bool) else 0.0
            out.append(
                {
                    "node": labels[a.node],
                    "rank": _int_or_none(row.get("rank")),
                    "pid": _int_or_none(row.get("pid")),
                    "step": step,
                    "step_time_s": seconds_ if math.isfinite(seconds_) and seconds_ > 0 else 0.0,
                    "last_artifact": row.get("last_artifact") if isinstance(row.get("last_artifact"), str) else None,
                }
            )
    return out


def _follow_traces(
    args: argparse.Namespace,
    client: SidecarClient,
    nodes: list[Node],
    labels: dict[Node, str],
    arm: list[NodeAnswer],
    at_step: int | None,
    progress: Progress,
    before: dict[tuple[str, int | None], str | None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per armed rank, the trace it got: followed through each node's ps until written.

    A rank's ps row names its trace group, start step and outcome (``trace``). A node whose
    dynprof predates that is followed by state alone: the rank's trace is written once it is
    idle with a new last artifact (``before``: each rank's last artifact before arming) or
    after it was seen armed or tracing; its status is then ``written``, the manifest has the rest."""
    before = before or {}
    seen_active: set[tuple[str, int]] = set()
    pending: dict[tuple[str, int], dict[str, Any]] = {}
    groups: dict[str, Any] = {}
    for a in arm:
        if not a.ok or not isinstance(a.result, dict):
            continue
        label = labels[a.node]
        groups[label] = a.result.get("group_id")
        for row in _rows(a, "targets"):
            pid = _int_or_none(row.get("pid"))
            if pid is None:
                continue
            pending[(label, pid)] = {
                "rank": _int_or_none(row.get("rank")),
                "pid": pid,
                "job": row.get("job"),
                "node": label,
                "start_step": _int_or_none(row.get("start_step")),
                "status": "armed",
                "artifact": None,
                "error": None,
            }
    done: list[dict[str, Any]] = []
    if args.no_wait:
        done = list(pending.values())
        pending = {}
    deadline = time.monotonic() + (args.timeout or START_WAIT_DEFAULT_S)
    by_label = {labels[n]: n for n in nodes}
    # A node that misses a poll is asked again; one silent this long is given up.
    silence_limit = max(START_SILENCE_MIN_S, 3 * args.node_timeout)
    last_heard = {label: time.monotonic() for label, _ in pending}
    while pending:
        asked = sorted({label for label, _ in pending})
        answers = client.action_all(
            [by_label[label] for label in asked], "ps", forward_options("ps", args, timeout=2.0), timeout=3.0
        )
        for a in answers:
            label = labels[a.node]
            if not a.answered:
                if time.monotonic() - last_heard[label] > silence_limit:
                    for key in [k for k in pending if k[0] == label]:
                        res = pending.pop(key)
                        res.update(
                            status="failed",
                            error=f"the node stopped answering for {silence_limit:g} s: {a.error}",
                        )
                        done.append(res)
                continue
            last_heard[label] = time.monotonic()
            listed = set()
            for row in _rows(a, "agents"):
                key = (label, _int_or_none(row.get("pid")) or 0)
                listed.add(key)
                if key not in pending:
                    continue
                raw = row.get("trace")
                state = row.get("state")
                artifact = row.get("last_artifact") if isinstance(row.get("last_artifact"), str) else None
                if not isinstance(raw, dict):  # a node without trace status in its ps
                    if state in ("armed", "tracing", "exporting"):
                        seen_active.add(key)
                        continue
                    if state != "idle" or not artifact:
                        continue
                    if key not in seen_active and (key not in before or before[key] == artifact):
                        continue
                    res = pending.pop(key)
                    res.update(status="written", artifact=artifact)
                    done.append(res)
                    continue
                if raw.get("group_id") != groups[label] or state != "idle":
                    continue
                res = pending.pop(key)
                res.update(
                    status=str(raw.get("last_artifact_status") or "failed"),
                    artifact=artifact,
                    error=str(raw["last_error"])[:2000] if raw.get("last_error") else None,
                    start_step=_int_or_none(raw.get("start_step")) or res["start_step"],
                )
                done.append(res)
            for key in [k for k in pending if k[0] == label and k not in listed]:
                res = pending.pop(key)
                res.update(status="failed", error="the process left the node's agent list before its trace was written")
                done.append(res)
        if not pending:
            break
        if time.monotonic() > deadline:
            for res in pending.values():
                res.update(status="timeout", error=f"not written within {args.timeout or START_WAIT_DEFAULT_S:g} s")
                done.append(res)
            break
        progress.update(f"tracing from step {at_step}: {len(done)}/{len(done) + len(pending)} rank(s) written")
        time.sleep(START_POLL_S)
    progress.done()
    done.sort(key=_rank_key)
    ok = ("complete", "partial", "armed") if args.no_wait else ("complete", "partial", "written")
    missed = []
    for res in done:
        if res["status"] not in ok:
            missed.append({"rank": res["rank"], "pid": res["pid"], "node": res["node"], "reason": res["error"]})
        elif at_step and res["start_step"] != at_step:
            missed.append(
                {
                    "rank": res["rank"],
                    "pid": res["pid"],
                    "node": res["node"],
                    "reason": f"armed at step {res['start_step']}, not {at_step}",
                }
            )
    return done, missed


def _start_as_is(args: argparse.Namespace, client: SidecarClient, nodes: list[Node]) -> int:
    """--duration, or until `dynprof stop`: every node starts its ranks as it would alone."""
    wait = args.timeout or START_WAIT_DEFAULT_S
    answers = client.action_all(nodes, "start", forward_options("start", args, timeout=wait), timeout=wait + 5.0)

    def line(r: dict[str, Any]) -> str:
        return f"{r.get('status', 'tracing')}: {r.get('artifact') or r.get('error') or r.get('state') or ''}"

    return _report_per_rank(args, client, nodes, answers, ("results", "targets"), line)


# -- artifacts -----------------------------------------------------------------------------------
def _artifacts_of(answers: list[NodeAnswer], labels: dict[Node, str], paths_of: Any) -> list[dict[str, Any]]:
    """Each answered node's artifact paths, as ``{"node", "path"}`` rows."""
    out = []
    for a in answers:
        if not a.answered:
            continue
        for path in paths_of(a.result) if isinstance(a.result, dict) else []:
            if isinstance(path, str) and path:
                out.append({"node": labels[a.node], "node_address": a.node.address, "path": path[:4096]})
    return out


def _maybe_fetch(
    args: argparse.Namespace, client: SidecarClient, answers: list[NodeAnswer], artifacts: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    fetch_dir = getattr(args, "fetch", None)
    if not fetch_dir:
        for art in artifacts:
            art.pop("node_address", None)
        return None
    # The answers name artifacts by their path on the node; the node's own listing gives the ids.
    by_node: dict[str, list[str]] = {}
    for art in artifacts:
        by_node.setdefault(art.pop("node_address"), []).append(art["path"])
    nodes = {a.node.address: a.node for a in answers}
    wanted: list[tuple[Node, Any]] = []
    job = getattr(args, "job", None)
    listings = client.action_all([nodes[n] for n in by_node], "ls", {"job": job} if job else {}, timeout=30.0)
    errors_: list[dict[str, Any]] = []
    for listing in listings:
        ids = {r.get("path"): r.get("id") for r in _rows(listing, "artifacts")}
        for path in by_node[listing.node.address]:
            if path in ids:
                wanted.append((listing.node, ids[path]))
            else:
                why = listing.error or "not in the node's store listing"
                errors_.append({"node": listing.node.address, "id": None, "path": None, "files": 0, "error": why})
    return fetch(client, Path(fetch_dir), wanted) + errors_


def fetch(client: SidecarClient, dest: Path, wanted: list[tuple[Node, Any]]) -> list[dict[str, Any]]:
    """Copy artifacts to ``dest/<id>/`` (the store's layout), each file checked against the
    manifest; an artifact already there with the same manifest is not copied again. Nodes are
    fetched from in parallel (at most the client's ``max_in_flight``), each node's artifacts one
    after the other; the rows come back in the order asked."""
    from concurrent.futures import ThreadPoolExecutor

    by_node: dict[Node, list[int]] = {}
    for i, (node, _) in enumerate(wanted):
        by_node.setdefault(node, []).append(i)
    rows: list[dict[str, Any]] = [{} for _ in wanted]

    def one_node(node: Node) -> None:
        for i in by_node[node]:
            rows[i] = _fetch_one(client, dest, node, wanted[i][1])

    if by_node:
        with ThreadPoolExecutor(max_workers=min(client.max_in_flight, len(by_node))) as pool:
            list(pool.map(one_node, by_node))
    return rows


def _fetch_one(client: SidecarClient, dest: Path, node: Node, artifact_id: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"node": node.address, "id": artifact_id, "path": None, "files": 0, "error": None}
    try:
        check_artifact_id(artifact_id)
        target = dest / artifact_id
        row["path"] = str(target)
        manifest = client.artifact(node, artifact_id)["manifest"]
        checked = _manifest_files(manifest)
        existing = target / "manifest.json"
        if existing.is_file() and _same_manifest(existing, manifest):
            row["files"] = len(checked)
            row["already_there"] = True
            return row
        _make_private_dirs(dest, target)
        for name, size, sha in checked:
            client.download(node, artifact_id, name, target / name, size, sha, FETCH_TIMEOUT_S)
            row["files"] += 1
        # The manifest last, private as the store's files are: its presence says the copy is whole.
        tmp = target / ".manifest.json.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(manifest, indent=2))
        os.replace(tmp, existing)
    except NodeFailure as exc:
        row["error"] = exc.reason
    except OSError as exc:
        row["error"] = f"cannot write under {dest}: {exc.strerror or exc}"
    return row


def _same_manifest(path: Path, manifest: dict[str, Any]) -> bool:
    try:
        return bool(json.loads(path.read_text()) == manifest)
    except (OSError, ValueError):
        return False


def _make_private_dirs(root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in target.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise NodeFailure(f"{current} is a link: not writing through it")
        current.mkdir(mode=0o700, exist_ok=True)


def _print_artifacts(artifacts: list[dict[str, Any]], fetched: list[dict[str, Any]] | None) -> None:
    for art in artifacts:
        print(printable(f"artifact on {art['node']}: {art['path']}"))
    for f in fetched or []:
        if f["error"]:
            print(printable(f"NOT FETCHED {f['id']} from {f['node']}: {f['error']}"))
        else:
            print(printable(f"fetched {f['files']} file(s) of {f['id']} from {f['node']} into {f['path']}"))
