"""Collect every rank's NCCL flight-recorder dump and say who is missing from which collective.

    dynprof nccl --job JOB          # every rank of the job on this node
    dynprof nccl --pid 4242,4243

The job must run with the recorder on (`dynprof run --flight-recorder -- ...`). Each rank's
agent asks torch for its dump; a rank whose agent cannot answer (its main thread holds the
GIL, or it has no agent) is asked through torch's own dump pipe, which needs no Python.
One artifact holds every rank's dump and the analysis: per process group, the last collective
sequence number each rank enqueued, started and completed; the collective the furthest ranks
wait in; and the ranks that never enqueued it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from dynprof import errors
from dynprof.cli._common import (
    add_attach_flag,
    add_json,
    add_targets,
    parallel,
    print_json,
    printable_lines,
    resolve_agents,
    seconds,
)
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.registry import AgentRecord, read_record


class NcclCommand:
    """Collect every rank's NCCL flight-recorder dump and say who is missing from which collective."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_targets(parser)
        add_attach_flag(parser)
        parser.add_argument("--only-active", action="store_true", help="only collectives not yet completed")
        parser.add_argument(
            "--no-stack-traces", action="store_true", help="leave out the Python stacks of each collective's caller"
        )
        parser.add_argument(
            "--timeout", type=seconds, default=15.0, metavar="SEC", help="per-rank limit for a dump (default 15)"
        )
        add_json(parser)
        add_many_node_args(parser, fetch=True)

    def run(self, args: argparse.Namespace) -> int:
        nodes = nodes_requested(args)
        if nodes is not None:
            from dynprof.cli import _many_nodes

            return _many_nodes.nccl(args, nodes)
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
            if writer.finished is None:
                writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
            raise
        elapsed = time.monotonic() - t0
        if args.json:
            # The artifact's id under the store: `nccl --hosts` reads every rank's dump from it
            # through each node's sidecar and analyses the dumps of all nodes together.
            print_json(
                {
                    "artifact": str(art.path),
                    "artifact_id": art.id,
                    "elapsed_s": round(elapsed, 3),
                    "analysis": analysis,
                    "notes": notes,
                }
            )
        else:
            print(printable_lines(fr.render_analysis(analysis)), end="")
            for n in notes:
                print(f"note: {n}")
            print(f"{len(per_rank)} rank(s) dumped in {elapsed:.2f} s; artifact {art.path}")
        return 1 if problems else 0

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
                doc = json.loads(path.read_text())
                return (rank if rank is not None else pid, doc, None)
            except errors.Unsupported:
                raise
            except errors.DynprofError as exc:
                reason = exc.message
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
