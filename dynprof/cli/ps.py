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
from typing import Any

from dynprof.cli._common import human_age, printable, seconds, table
from dynprof.cli.job import JobCommand, Text, answered_count
from dynprof.job import ps
from dynprof.node_requests import PS_TIMEOUT_S, PsRequest
from dynprof.result import Result


class PsCommand(JobCommand):
    """List the dynprof agents on this node, newest first."""

    name = "ps"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--job", help="only this job's agents")
        parser.add_argument(
            "--timeout",
            type=seconds,
            default=PS_TIMEOUT_S,
            help=f"seconds to wait for each agent (default {PS_TIMEOUT_S:g})",
        )

    def collect_local(self, args: argparse.Namespace) -> Result:
        return ps.collect(request_from_args(args))

    def render(self, result: Result) -> str:
        if not isinstance(result, ps.Agents):
            return _render_nodes(result.to_json())  # the job-wide answer
        rows, job = result.agents, result.job
        if not rows:
            return (
                "no dynprof agents on this node"
                + (f" for job {printable(job)}" if job else "")
                + "\nstart one with: dynprof run -- python train.py   (or DYNPROF=1 in the job's environment)"
            )
        return table(
            [
                (
                    r["pid"],
                    r["role"],
                    r["rank"] if r["rank"] is not None else "-",
                    r["job"] or "-",
                    r["step"] if r.get("step") is not None else "-",
                    r["state"] + (f" (in phase {r['phase']})" if r.get("phase") else "") + _checkpoint(r),
                    human_age(r["age_s"]),
                    " ".join(r["cmdline"])[:60],
                )
                for r in rows
            ],
            ["PID", "ROLE", "RANK", "JOB", "STEP", "STATE", "AGE", "COMMAND"],
        )


def _checkpoint(row: dict[str, Any]) -> str:
    """`dynprof run --checkpoint`'s state, as STATE shows it beside the trace's."""
    c = row.get("checkpoint")
    if not isinstance(c, dict):
        return ""
    state = printable(str(c.get("state")))
    modules = c.get("modules")
    n = len(modules) if isinstance(modules, list) else 0
    return f", checkpoint {state}" + (f" ({n} blocks)" if n else "")


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _age(value: Any) -> str:
    """A node's ``age_s``, as AGE shows it ("-" when it is not a number)."""
    if not isinstance(value, (int, float)):
        return "-"
    try:
        return human_age(float(value or 0))
    except OverflowError:  # an int too large for a float
        return "?"


def _render_nodes(doc: dict[str, Any]) -> str:
    rows = doc["agents"]
    text = Text()
    text.print(
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
                    _age(r.get("age_s")),
                    " ".join(str(c) for c in _list(r.get("cmdline")))[:50],
                )
                for r in rows
            ],
            ["NODE", "RANK", "PID", "ROLE", "JOB", "STEP", "STATE", "AGE", "COMMAND"],
        )
    )
    text.print(f"\n{len(rows)} agent(s) on {answered_count(doc)} node(s)")
    text.footer(doc)
    return text.value()


def request_from_args(args: argparse.Namespace) -> PsRequest:
    """The options of `dynprof ps` on this node as its request."""
    return PsRequest(job=args.job, timeout=args.timeout)
