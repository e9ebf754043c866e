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
from collections.abc import Callable
from typing import Any

from collectors.flight_recorder.collect import NcclRequest
from dynprof.cli._common import (
    add_attach_flag,
    add_targets,
    attach_first,
    printable_lines,
    seconds,
)
from dynprof.cli.job import (
    JobCommand,
    JobResult,
    Reach,
    Text,
    answered_count,
    artifacts_of,
    envelope,
    exit_code,
    fetched_doc,
    maybe_fetch,
    node_messages,
    with_fetch,
)
from dynprof.nodes import Node
from dynprof.result import Result


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
        request = request_from_args(args)
        if args.attach:
            attach_first(args)
        return self.collect_request(request)

    def collect_request(self, request: NcclRequest) -> Result:
        """This node's answer to ``request``: the analysis of its ranks' dumps, and the artifact."""
        from collectors.flight_recorder.collect import collect

        got = collect(request)
        # The artifact's id under the store: `nccl --hosts` reads every rank's dump from it
        # through each node's sidecar and analyses the dumps of all nodes together.
        doc = {
            "artifact": got.artifact,
            "artifact_id": got.artifact_id,
            "elapsed_s": round(got.elapsed_s, 3),
            "analysis": got.analysis,
            "notes": got.notes,
        }
        return JobResult(doc, 1 if got.partial else 0, context={"ranks": len(got.ranks), "elapsed_s": got.elapsed_s})

    def action_requests(self) -> dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[[Any], Result]]]:
        """The sidecar's ``nccl`` action read as the kind's request."""
        return {"nccl": (NcclRequest.from_json, self.collect_request)}

    def collect_job(self, options: dict[str, Any], nodes: list[Node], reach: Reach) -> Result:
        """Each node dumps its ranks' flight recorders into one artifact; every rank's dump is
        read back from those artifacts and all are analysed together (:mod:`dynprof.job.nccl`)."""
        from dynprof.job.nccl import collect_nodes

        request = NcclRequest.from_json(options)
        got = collect_nodes(reach.client, nodes, request)
        artifacts = artifacts_of(got.answers, got.labels, lambda r: [r.get("artifact")])
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


def request_from_args(args: argparse.Namespace) -> NcclRequest:
    """The options of `dynprof nccl` as the kind's request."""
    return NcclRequest(
        pids=tuple(args.pid or ()),
        job=args.job,
        all=bool(args.all),
        only_active=args.only_active,
        stack_traces=not args.no_stack_traces,
        timeout=args.timeout,
    )
