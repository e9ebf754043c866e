"""Collect every rank's NCCL flight-recorder dump and say who is missing from which collective.

    dynprof nccl --job JOB          # every rank of the job on this node
    dynprof nccl --pid 4242,4243

The job must run with the recorder on (`dynprof run --flight-recorder -- ...`). Each rank's
agent asks torch for its dump; a rank whose agent cannot answer (its main thread holds the
GIL, or it has no agent) is asked through torch's own dump pipe, which needs no Python.
One artifact holds every rank's dump and the analysis: per process group, the last collective
sequence number each rank enqueued, started and completed; the collective the furthest ranks
wait in; and the ranks that never enqueued it.

A rank's dump is read up to 64 MiB; a larger one is that rank's failure, named with its size.
Over many nodes (--hosts), at most 2 GiB of dumps are read back in all.
"""

from __future__ import annotations

import argparse
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from dynprof import errors, untrusted
from dynprof.cli._common import (
    add_attach_flag,
    add_targets,
    parallel,
    printable_lines,
    resolve_agents,
    seconds,
)
from dynprof.cli.job import (
    JobCommand,
    JobResult,
    Text,
    answered_count,
    artifacts_of,
    envelope,
    exit_code,
    fetched_doc,
    forward_options,
    maybe_fetch,
    node_messages,
    with_fetch,
)
from dynprof.nodes import Node
from dynprof.registry import AgentRecord, read_record
from dynprof.result import Result
from dynprof.units import human_bytes

if TYPE_CHECKING:
    from dynprof.job.client import SidecarClient

MAX_DUMP_BYTES = 64 * 1024 * 1024
"""The largest rank's dump read (on this node or back from a node): its parsed form takes a few
times its size in memory."""
MAX_DUMPS_TOTAL_BYTES = 2 * 1024**3
"""The most bytes of dumps `nccl --hosts` reads back from all nodes together."""
_DUMP_FILE = re.compile(r"rank(\d{1,9})-pid\d{1,9}\.json")


class NcclCommand(JobCommand):
    """Collect every rank's NCCL flight-recorder dump and say who is missing from which collective."""

    name = "nccl"
    takes_fetch = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser)
        add_attach_flag(parser)
        parser.add_argument("--only-active", action="store_true", help="only collectives not yet completed")
        parser.add_argument(
            "--no-stack-traces", action="store_true", help="leave out the Python stacks of each collective's caller"
        )
        parser.add_argument(
            "--timeout", type=seconds, default=15.0, metavar="SEC", help="per-rank limit for a dump (default 15)"
        )

    def collect_local(self, args: argparse.Namespace) -> Result:
        from collectors import flight_recorder as fr
        from dynprof.store import ArtifactStore

        targets = self._targets(args)
        jobs = {r.job_id for _, r in targets if r is not None and r.job_id}
        job = args.job or (jobs.pop() if len(jobs) == 1 else None)
        t0 = time.monotonic()
        writer = ArtifactStore().create(
            fr.KIND,
            job=job,
            options={
                "targets": [pid for pid, _ in targets],
                "only_active": args.only_active,
                "stack_traces": not args.no_stack_traces,
            },
        )
        try:
            results = parallel(lambda t: self._dump(t[0], t[1], writer, args), targets)
            per_rank: dict[int, dict[str, Any]] = {}
            notes: list[str] = []
            problems: list[tuple[int, errors.DynprofError]] = []
            for (pid, _record), res in zip(targets, results):
                if isinstance(res, errors.DynprofError):
                    problems.append((pid, res))
                    continue
                if isinstance(res, Exception):
                    raise res
                rank, doc, note = res
                per_rank[rank] = doc
                if note:
                    notes.append(note)
            if not per_rank:
                not_enabled: list[errors.DynprofError] = [e for _, e in problems if isinstance(e, errors.Unsupported)]
                first = (not_enabled or [e for _, e in problems])[0]
                if len(not_enabled) == len(problems):
                    # no rank records (the job runs without the recorder): nothing to keep
                    writer.abort("the flight recorder is off")
                else:
                    writer.finish("failed", error=first.message)
                raise first
            analysis = fr.analyze(per_rank)
            for pid, exc in problems:
                notes.append(f"pid {pid}: no dump: {exc.message}")
            writer.write_json("analysis.json", analysis)
            writer.write_text("analysis.txt", fr.render_analysis(analysis) + "".join(f"note: {n}\n" for n in notes))
            summary = {
                "ranks": sorted(per_rank),
                "notes": notes,
                "verdicts": [pg["verdict"] for pg in analysis["process_groups"]],
                "hung": [pg["process_group"] for pg in analysis["process_groups"] if pg["hung"]],
            }
            art = writer.finish("partial" if problems else "complete", summary=summary)
        except BaseException as exc:
            if writer.finished is None and writer.aborted is None:
                writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
            raise
        elapsed = time.monotonic() - t0
        # The artifact's id under the store: `nccl --hosts` reads every rank's dump from it
        # through each node's sidecar and analyses the dumps of all nodes together.
        doc = {
            "artifact": str(art.path),
            "artifact_id": art.id,
            "elapsed_s": round(elapsed, 3),
            "analysis": analysis,
            "notes": notes,
        }
        return JobResult(doc, 1 if problems else 0, context={"ranks": len(per_rank), "elapsed_s": elapsed})

    def collect_nodes(self, args: argparse.Namespace, nodes: list[Node]) -> Result:
        """Each node dumps its ranks' flight recorders into one artifact; every rank's dump is
        read back from those artifacts (through the sidecars, checked against their manifests)
        and all are analysed together."""
        from collectors import flight_recorder as fr
        from dynprof.job.answers import as_list, node_labels
        from dynprof.job.client import NodeFailure
        from dynprof.job.fetch import Budget, artifact_ids
        from dynprof.nodes import NodeAnswer

        client = self.client(args)
        answers = client.action_all(nodes, "nccl", forward_options("nccl", args), timeout=args.timeout + 5.0)
        labels = node_labels(nodes)
        notes: list[str] = []
        for a in answers:
            result = a.result if isinstance(a.result, dict) else {}
            notes.extend(f"{labels[a.node]}: {str(n)[:2000]}" for n in as_list(result.get("notes")))
        ids = artifact_ids(client, answers, "nccl", args.job)
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
        artifacts = artifacts_of(answers, labels, lambda r: [r.get("artifact")])
        fetched = maybe_fetch(args, client, answers, artifacts)
        code = with_fetch(exit_code(answers), fetched)
        if analysis is None and code == 0:
            code = 1
        # No node's ranks record (each answered that the recorder is off): the job runs without it.
        refused = [a.failure for a in answers if a.answered and a.failure is not None]
        recorder_off = not per_rank and bool(refused) and len(refused) == len(answers)
        recorder_off = recorder_off and all(f.type == errors.Unsupported.__name__ for f in refused)
        doc = {
            **envelope(answers),
            "analysis": analysis,
            "recorder_off": recorder_off,
            "ranks": {str(r): where[r] for r in sorted(per_rank)},
            "notes": notes,
            "artifacts": artifacts,
            **fetched_doc(fetched),
        }
        return JobResult(doc, code, node_messages(answers))

    def render(self, result: Result) -> str:
        from collectors import flight_recorder as fr

        doc = result.to_json()
        context = result.context if isinstance(result, JobResult) else {}
        text = Text()
        if "nodes" not in doc:
            text.print(printable_lines(fr.render_analysis(doc["analysis"])), end="")
            for n in doc["notes"]:
                text.print(f"note: {n}")
            text.print(f"{context['ranks']} rank(s) dumped in {context['elapsed_s']:.2f} s; artifact {doc['artifact']}")
            return text.value()
        if doc["analysis"] is not None:
            text.print(printable_lines(fr.render_analysis(doc["analysis"])), end="")
        for n in doc["notes"]:
            text.print(printable_lines(f"note: {n}"))
        text.artifacts(doc["artifacts"], doc.get("fetched"))
        text.print(f"{len(doc['ranks'])} rank(s) dumped on {answered_count(doc)} of {len(doc['nodes'])} node(s)")
        text.footer(doc)
        return text.value()

    def _targets(self, args: argparse.Namespace) -> list[tuple[int, AgentRecord | None]]:
        if args.pid:
            out: list[tuple[int, AgentRecord | None]] = []
            for pid in dict.fromkeys(args.pid):
                errors.probe_pid(pid)
                record = read_record(pid)
                out.append((pid, record if record is not None and record.is_alive() else None))
            return out
        return [(r.pid, r) for r in resolve_agents(args)]

    def _dump(self, pid: int, record: AgentRecord | None, writer: Any, args: argparse.Namespace) -> Any:
        from collectors import flight_recorder as fr
        from dynprof.client import AgentClient
        from dynprof.proto import pb

        rank = record.rank if record is not None else None
        if rank is None:
            rank = _environ_rank(pid)
        stem = f"rank{rank}-pid{pid}" if rank is not None else f"pid{pid}"
        reason = "no dynprof agent"
        if record is not None:
            path = writer.file_path(f"{stem}.json")
            try:
                AgentClient.for_record(record, timeout=args.timeout).request(
                    flight_recorder_dump=pb.FlightRecorderDumpRequest(
                        output_path=str(path),
                        include_stack_traces=not args.no_stack_traces,
                        only_active=args.only_active,
                    )
                )
            except errors.Unsupported:
                raise
            except errors.DynprofError as exc:
                reason = exc.message
            else:
                return (rank if rank is not None else pid, _read_dump(path.parent, path.name, pid), None)
        if rank is None:
            raise errors.DynprofError(f"pid {pid}: cannot tell its rank ({reason}), so cannot find its dump pipe")
        try:
            raw, where = fr.dump_through_pipe(pid, rank, timeout=args.timeout)
        except fr.NotEnabled as exc:
            raise errors.Unsupported(str(exc), help=_not_enabled_help()) from None
        except fr.DumpError as exc:
            raise errors.DynprofError(f"pid {pid}: {reason}; and through torch's pipe: {exc}") from None
        writer.write_bytes(f"{stem}.raw", raw)
        doc = {
            "schema": fr.SCHEMA,
            "schema_version": fr.SCHEMA_VERSION,
            "method": "pipe",
            "pid": pid,
            "rank": rank,
            "dumps": {"nccl": fr.load_dump_bytes(raw)},
            "source": where,
        }
        writer.write_json(f"{stem}.json", doc)
        return (rank, doc, f"rank {rank}: dumped through torch's pipe ({reason})")


def _environ_rank(pid: int) -> int | None:
    from collectors.flight_recorder import process_environ

    try:
        value = process_environ(pid).get("RANK")
    except OSError:
        return None
    return int(value) if value and value.isdigit() else None


def _not_enabled_help() -> str:
    from dynprof.errors import FLIGHT_RECORDER_HELP

    return FLIGHT_RECORDER_HELP


def _read_dump(directory: Any, name: str, pid: int) -> Any:
    """A rank's dump as its agent wrote it, refused over MAX_DUMP_BYTES (that rank's failure)."""
    try:
        data = untrusted.read_bytes_in(directory, name, MAX_DUMP_BYTES)
        return untrusted.loads_json(data, f"the dump of pid {pid}")
    except errors.ArtifactError as exc:
        raise errors.DynprofError(
            f"pid {pid}: its dump cannot be read: {exc.message}",
            help=f"A dump is read up to {human_bytes(MAX_DUMP_BYTES)}: leave out the stacks (--no-stack-traces) "
            "or the completed collectives (--only-active), or record fewer (`dynprof run --flight-recorder N`).",
        ) from None


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
