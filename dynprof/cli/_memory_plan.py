"""`dynprof memory plan`: measure the next step of running processes and plan what to checkpoint."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from collectors.memory.plan import from_json, make_plan, render_text
from dynprof import errors
from dynprof.cli._common import parallel, resolve_agents, table
from dynprof.client import AgentClient
from dynprof.proto import pb
from dynprof.untrusted import loads_json

POLL_S = 0.2
MAX_MEASUREMENT_BYTES = 8 * 1024 * 1024


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """``SIZE`` (bytes, K/M/G/T) or ``P%`` (of the measured peak): (bytes, fraction)."""
    from dynprof.units import parse_size

    raw = text.strip()
    if raw.endswith("%"):
        try:
            value = float(raw[:-1])
        except ValueError:
            value = -1.0
        if not 0 < value < 100:
            raise errors.UsageError(
                f"--budget {text!r}: a percentage must be between 0 and 100", help="Write e.g. 60% or 40G."
            )
        return None, value / 100.0
    try:
        return parse_size(raw), None
    except errors.DynprofError as exc:
        raise errors.UsageError(
            f"--budget/--save {text!r}: {exc.message}", help="Write e.g. 40G, 512M or 60%."
        ) from None


def asked_bytes(measurement: dict[str, Any], budget: str | None, save: str | None) -> dict[str, int]:
    """The budget or the saving asked for, in bytes of this measurement: ``{"budget_bytes": N}``
    or ``{"save_bytes": N}`` (a percentage is of the measured peak)."""
    m = from_json(measurement)
    if budget is not None:
        size, fraction = parse_budget(budget)
        return {"budget_bytes": size if size is not None else int(m.peak_bytes * (fraction or 0))}
    size, fraction = parse_budget(save or "")
    return {"save_bytes": size if size is not None else int(m.peak_bytes * (fraction or 0))}


def plan_document(measurement: dict[str, Any], budget: str | None, save: str | None) -> dict[str, Any]:
    m = from_json(measurement)
    asked = asked_bytes(measurement, budget, save)
    if "budget_bytes" in asked:
        return make_plan(m, budget=asked["budget_bytes"])
    return make_plan(m, save=asked["save_bytes"])


def save_plan(record: Any, measurement: dict[str, Any], args: argparse.Namespace) -> str:
    """Keep the measurement and what was asked as a ``memory-plan`` artifact; its path."""
    from collectors.memory.plan import KIND, PLAN_FILE
    from dynprof.store import ArtifactStore

    asked = asked_bytes(measurement, args.budget, args.save)
    writer = ArtifactStore().create(
        KIND,
        job=record.job_id,
        host=record.host or None,
        rank=record.rank,
        pid=record.pid,
        options={"budget": args.budget, "save": args.save},
    )
    with writer:
        writer.write_json(PLAN_FILE, {"schema": 1, "measurement": measurement, "asked": asked})
        return str(writer.finish("complete", summary=asked).path)


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if args.budget is None and args.save is None:
        raise errors.UsageError(
            "dynprof memory plan needs --budget SIZE or --save SIZE",
            help="Say what the step's peak must fit in (--budget 40G, --budget 60%) or how much to save (--save 8G).",
        )
    parse_budget(args.budget if args.budget is not None else args.save)  # bad input fails before any request
    records = resolve_agents(args)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    deadline = time.monotonic() + args.timeout

    def ask(record: Any) -> Any:
        client = AgentClient.for_record(record, timeout=10.0)
        while True:
            reply = client.request(memory_plan=pb.MemoryPlanRequest(token=token))
            state = reply.artifact.status
            if state in ("complete", "failed"):
                return reply.artifact
            if time.monotonic() > deadline:
                raise errors.Timeout(
                    f"pid {record.pid}: no training step within {args.timeout:g} s (state: {state})",
                    help="The job must be stepping its optimizer; raise --timeout for long steps. The "
                    "measurement is dropped by the agent if its step does not come.",
                )
            time.sleep(POLL_S)

    replies = parallel(ask, records)
    results: list[dict[str, Any]] = []
    failures: list[errors.DynprofError] = []
    save_errors: list[str] = []
    for record, reply in zip(records, replies):
        res: dict[str, Any] = {"pid": record.pid, "rank": record.rank, "job": record.job_id}
        if isinstance(reply, errors.DynprofError):
            res.update(status="failed", error=reply.message, help=reply.help, exit_code=reply.exit_code)
            failures.append(reply)
        elif isinstance(reply, Exception):
            raise reply
        else:
            text = reply.summary_json or "{}"
            try:
                if len(text) > MAX_MEASUREMENT_BYTES:
                    raise errors.ArtifactError(
                        f"pid {record.pid}: the measurement is over {MAX_MEASUREMENT_BYTES} bytes"
                    )
                doc = loads_json(text, f"pid {record.pid}'s memory plan measurement", max_values=1_000_000)
                if not isinstance(doc, dict):
                    raise errors.ArtifactError(f"pid {record.pid}: the measurement is not a JSON object")
                plan = plan_document(doc, args.budget, args.save) if reply.status == "complete" else None
            except errors.ArtifactError as exc:
                res.update(status="failed", error=exc.message, help=exc.help, exit_code=exc.exit_code)
                failures.append(exc)
                results.append(res)
                continue
            if reply.status != "complete":
                err = errors.AgentError(
                    f"pid {record.pid}: the measurement failed: {str(doc.get('error', '?'))[:500]}",
                    help="See the agent log in the dynprof runtime directory (logs/PID.log).",
                )
                res.update(status="failed", error=err.message, help=err.help, exit_code=err.exit_code)
                failures.append(err)
            else:
                res.update(status="ok", plan=plan)
                try:
                    res["artifact"] = save_plan(record, doc, args)
                except (OSError, errors.DynprofError) as exc:
                    res["artifact"] = None
                    save_errors.append(f"pid {record.pid}: the plan was not saved: {exc}")
        results.append(res)
    failed = [r for r in results if r["status"] != "ok"]
    code = 0
    if failed:
        codes = {r.get("exit_code", 1) for r in failed}
        code = codes.pop() if len(codes) == 1 else 1
    if len(results) == 1 and failures and not getattr(args, "json", False):
        raise failures[0]
    return {"schema": 1, "results": results, "notes": save_errors}, code


def render(doc: dict[str, Any]) -> str:
    parts = []
    rows = []
    for r in doc["results"]:
        who = f"rank {r['rank']}" if r["rank"] is not None else "-"
        if r["status"] != "ok":
            rows.append([who, r["pid"], "failed", r["error"]])
            continue
        kept = f"\n(kept in {r['artifact']}: `dynprof show` it)" if r.get("artifact") else ""
        parts.append(f"{who}, pid {r['pid']}:\n" + render_text(r["plan"]) + kept)
    if rows:
        parts.append(table(rows, ["rank", "pid", "status", "result"]))
        parts.extend(f"  what to do: {r['help']}" for r in doc["results"] if r["status"] != "ok" and r.get("help"))
    return "\n\n".join(parts)
