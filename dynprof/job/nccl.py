"""The NCCL flight recorders of a whole job: every node's sidecar dumps its ranks' recorders
into one artifact (its ``nccl`` action, :func:`collectors.flight_recorder.collect.collect`
there); each rank's dump is read back from those artifacts, checked against their manifests,
and all are analysed together. ``dynprof nccl --hosts`` and the sidecar's job-wide ``nccl``
answer with :func:`collect_job`; the watch calls :func:`collect_nodes`. Each node's answer is
read by the kind's own decoder (:meth:`collectors.flight_recorder.collect.Collected.from_json`).

A rank's dump is read up to 64 MiB; at most :data:`MAX_DUMPS_TOTAL_BYTES` of dumps are read
back from all nodes together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collectors import flight_recorder as fr
from collectors.flight_recorder import collect as kind
from collectors.flight_recorder.collect import MAX_DUMP_BYTES, Collected, NcclRequest
from dynprof import errors
from dynprof.action_spec import ActionSpec
from dynprof.job.answers import node_labels
from dynprof.job.merge import (
    JobResult,
    Reach,
    artifacts_of,
    envelope,
    exit_code,
    fetched_doc,
    maybe_fetch,
    node_messages,
    with_fetch,
)
from dynprof.nodes import Node, NodeAnswer
from dynprof.units import human_bytes

if TYPE_CHECKING:
    from dynprof.job.client import SidecarClient

MAX_DUMPS_TOTAL_BYTES = 2 * 1024**3
"""The most bytes of dumps read back from all nodes together."""
ACTION_MARGIN_S = 5.0  # a node's answer may take this much past the request's own timeout
_DUMP_FILE = re.compile(r"rank(\d{1,9})-pid\d{1,9}\.json")


@dataclass
class NodesCollected:
    """The nodes' answers (and how output names each node), the analysis of every rank's dump
    read back (``None`` when none was), on which node each rank was dumped, the notes, and
    whether every node answered that its ranks do not record (``recorder_off``)."""

    answers: list[NodeAnswer]
    labels: dict[Node, str]
    analysis: dict[str, Any] | None
    where: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recorder_off: bool = False


def collect_job(options: dict[str, Any], nodes: list[Node], reach: Reach) -> JobResult:
    """Each node dumps its ranks' flight recorders into one artifact; every rank's dump is
    read back from those artifacts and all are analysed together (:func:`collect_nodes`)."""
    request = NcclRequest.from_json(options)
    got = collect_nodes(reach.client, nodes, request)
    artifacts = artifacts_of(got.answers, got.labels, lambda a: [a.result.get("artifact")])
    fetched = maybe_fetch(reach, request.job, got.answers, artifacts)
    code = with_fetch(exit_code(got.answers), fetched)
    if got.analysis is None and code == 0:
        code = 1
    doc = {
        **envelope(got.answers),
        "analysis": got.analysis,
        "recorder_off": got.recorder_off,
        "ranks": {str(r): got.where[r] for r in sorted(got.where)},
        "notes": got.notes,
        "artifacts": artifacts,
        **fetched_doc(fetched),
    }
    return JobResult(doc, code, node_messages(got.answers))


def collect_nodes(
    client: SidecarClient,
    nodes: list[Node],
    request: NcclRequest,
    skip: Mapping[Node, Sequence[int]] | None = None,
) -> NodesCollected:
    """Ask every node's sidecar for ``request`` and analyse the dumps of all nodes together.
    ``skip``: per node, processes of the job it does not ask (a job-wide request only)."""
    from dynprof.job.client import NodeFailure
    from dynprof.job.fetch import Budget, artifact_ids

    plain = request.options()

    def options_of(node: Node) -> dict[str, Any]:
        pids = sorted(set((skip or {}).get(node, ())))
        return {**plain, "skip_pid": pids} if pids else plain

    # each node its own options only where some node has processes to leave out
    options = options_of if skip and any(skip.values()) else plain
    answers = client.action_all(nodes, "nccl", options, timeout=request.timeout + ACTION_MARGIN_S)
    labels = node_labels(nodes)
    notes: list[str] = []
    for a in answers:
        notes.extend(f"{labels[a.node]}: {n}" for n in Collected.from_json(a.result).notes)
    ids = artifact_ids(client, answers, "nccl", request.job)
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
    budget = Budget(MAX_DUMPS_TOTAL_BYTES)

    def read(i: int) -> list[tuple[int, dict[str, Any]]]:
        a, artifact_id = readable[i]
        return read_rank_dumps(client, a.node, artifact_id, node_notes[i], labels[a.node], budget)

    with ThreadPoolExecutor(max_workers=max(1, min(client.max_in_flight, len(readable)))) as pool:
        dumps = list(pool.map(read, range(len(readable))))
    for (a, _), found, more in zip(readable, dumps, node_notes):
        label = labels[a.node]
        notes.extend(more)
        for rank, dump in found:
            if rank in per_rank:
                notes.append(f"rank {rank} dumped on {where[rank]} and on {label}: the one of {where[rank]} kept")
                continue
            per_rank[rank], where[rank] = dump, label
    analysis: dict[str, Any] | None = None
    if per_rank:
        try:
            analysis = fr.analyze(per_rank)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            notes.append(f"the dumps could not be analysed together: {type(exc).__name__}: {exc}")
    # No node's ranks record (each answered that the recorder is off): the job runs without it.
    refused = [a.failure for a in answers if a.answered and a.failure is not None]
    recorder_off = not per_rank and bool(refused) and len(refused) == len(answers)
    recorder_off = recorder_off and all(f.type == errors.Unsupported.__name__ for f in refused)
    return NodesCollected(answers, labels, analysis, where, notes, recorder_off)


def read_rank_dumps(
    client: SidecarClient, node: Node, artifact_id: str, notes: list[str], label: str, budget: Any = None
) -> list[tuple[int, dict[str, Any]]]:
    """The ranks' dumps (``rank<R>-pid<P>.json``) of one node's nccl artifact. A dump that its
    manifest says is over MAX_DUMP_BYTES (or past what ``budget`` leaves), or that does not
    check out, is a note naming it, and the others are still read."""
    from dynprof.job.client import NodeFailure
    from dynprof.job.fetch import manifest_files, read_json_file

    try:
        with client.manifest(node, artifact_id) as doc:
            files = manifest_files(doc["manifest"])
    except NodeFailure as exc:
        notes.append(f"{label}: its dumps cannot be read: {exc.reason}")
        return []
    out = []
    for name, size, sha in files:
        match = _DUMP_FILE.fullmatch(name)
        if match is None:
            continue
        rank = int(match.group(1))
        if size <= MAX_DUMP_BYTES and budget is not None and not budget.take(size):
            notes.append(
                f"{label}: rank {rank}: {artifact_id}/{name}: not read, past the "
                f"{human_bytes(budget.limit)} of dumps read back in all"
            )
            continue
        try:
            doc = read_json_file(client, node, artifact_id, name, size, sha, MAX_DUMP_BYTES, f"{name} of {label}")
        except NodeFailure as exc:
            notes.append(f"{label}: {exc.reason}")
            continue
        except errors.ArtifactError as exc:
            notes.append(f"{label}: {exc.message}")
            continue
        if isinstance(doc, dict):
            out.append((rank, doc))
    return out


# The sidecar's ``nccl`` action (the kinds' table names it): the recorders dumped on a node, or,
# job-wide, on every node and analysed together.
ACTION = ActionSpec(
    NcclRequest,
    kind.collect,
    collect_job,
    limits={"timeout_option": "timeout", "default_timeout_s": 15.0, "max_timeout_s": 300.0, "changes_jobs": True},
)
