"""List the dynprof agents on this node, newest first.

Each agent is asked for its live state (step, trace state); one that does not answer within
the timeout is shown as `unresponsive` (its process may hold the GIL in C code: try
`dynprof stacks`). One that answers with an error, or not in the protocol, is shown as `error`,
the error is printed on stderr, and the command exits 8 (after listing every agent).

ROLE says what each process is in its job (``dynprof.roles``): ``trainer``, ``launcher``
(torchrun, accelerate launch, a wrapper of the script), ``other`` (not known to train yet);
DataLoader workers have no agent. Commands given ``--job`` target the trainers.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from dynprof import errors, roles
from dynprof.cli._common import add_json, human_age, parallel, print_json, printable, seconds, table
from dynprof.cli._node_args import add_many_node_args, nodes_requested
from dynprof.client import AgentClient
from dynprof.registry import AgentRecord, list_records


def agent_rows(records: list[AgentRecord], timeout: float) -> list[dict[str, Any]]:
    def query(record: AgentRecord) -> Any:
        return AgentClient.for_record(record, timeout=timeout).status()

    statuses = parallel(query, records)
    now = time.time()
    for record, status in zip(records, statuses):
        if not isinstance(status, Exception):
            record.rank = status.rank if status.rank >= 0 else None
            record.job_id = status.job_id or None
            record.role = status.role if status.role in roles.ROLES else record.role
    role_of = roles.job_roles(records)
    rows = []
    for record, status in zip(records, statuses):
        row: dict[str, Any] = {
            "pid": record.pid,
            "ppid": record.ppid,
            "rank": record.rank,
            "local_rank": record.local_rank,
            "world_size": record.world_size,
            "job": record.job_id,
            "host": record.host,
            "age_s": round(now - record.started_at, 1),
            "cmdline": record.cmdline,
            "torch": record.torch_version,
            "activation": record.activation,
            "role": role_of[record.pid],
            "phase": None,
            "phase_since": None,
        }
        if isinstance(status, Exception):
            row.update(
                state="unresponsive" if isinstance(status, errors.Timeout) else "error", step=None, error=str(status)
            )
        else:
            row.update(
                rank=status.rank if status.rank >= 0 else None,
                world_size=status.world_size if status.world_size >= 0 else None,
                job=status.job_id or None,
                state=status.trace.state,
                step=status.step,
                step_time_ms=round(status.step_time_s * 1000, 3) if status.step_time_s else None,
                torch_imported=status.torch_imported,
                cuda_initialized=status.cuda_initialized,
                phase=status.phase or None,
                phase_since=status.phase_since or None,
                memory_history=status.memory_history,
                memory_history_detail=status.memory_history_detail or None,
                last_artifact=status.trace.last_artifact or None,
                # what `start --hosts` follows a trace by, node by node
                trace={
                    "group_id": status.trace.group_id or None,
                    "start_step": status.trace.start_step,
                    "steps_done": status.trace.steps_done,
                    "last_artifact_status": status.trace.last_artifact_status or None,
                    "last_error": status.trace.last_error or None,
                },
            )
        rows.append(row)
    return rows


class PsCommand:
    """List the dynprof agents on this node, newest first."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job's agents")
        parser.add_argument("--timeout", type=seconds, default=1.0, help="seconds to wait for each agent (default 1)")
        add_json(parser)
        add_many_node_args(parser)

    def run(self, args: argparse.Namespace) -> int:
        nodes = nodes_requested(args)
        if nodes is not None:
            from dynprof.cli import _many_nodes

            return _many_nodes.ps(args, nodes)
        records = list_records()
        if args.job:
            records = [r for r in records if r.job_id == args.job]
        rows = agent_rows(records, args.timeout)
        failed = [r for r in rows if r["state"] == "error"]
        code = errors.AgentError.exit_code if failed else 0
        for r in failed:
            print(f"dynprof: agent of pid {r['pid']}: {printable(r['error'])}", file=sys.stderr)
        if args.json:
            print_json({"agents": rows})
            return code
        if not rows:
            print("no dynprof agents on this node" + (f" for job {printable(args.job)}" if args.job else ""))
            print("start one with: dynprof run -- python train.py   (or DYNPROF=1 in the job's environment)")
            return 0
        print(
            table(
                [
                    (
                        r["pid"],
                        r["role"],
                        r["rank"] if r["rank"] is not None else "-",
                        r["job"] or "-",
                        r["step"] if r.get("step") is not None else "-",
                        r["state"] + (f" (in phase {r['phase']})" if r.get("phase") else ""),
                        human_age(r["age_s"]),
                        " ".join(r["cmdline"])[:60],
                    )
                    for r in rows
                ],
                ["PID", "ROLE", "RANK", "JOB", "STEP", "STATE", "AGE", "COMMAND"],
            )
        )
        return code
