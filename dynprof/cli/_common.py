"""Pieces shared by the subcommands: option groups, target selection, output."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynprof import errors
from dynprof.registry import AgentRecord, list_records, read_record
from dynprof.units import human_bytes as human_bytes  # re-exported for the subcommands


# -- option groups -----------------------------------------------------------------------------
def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def parse_pids(text: str) -> list[int]:
    pids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            pid = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a pid") from None
        if pid <= 0:
            raise argparse.ArgumentTypeError(f"{pid} is not a valid pid")
        pids.append(pid)
    if not pids:
        raise argparse.ArgumentTypeError("no pid given")
    return pids


def add_targets(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--pid", type=parse_pids, metavar="PID[,PID...]", help="target process ids")
    group.add_argument("--job", metavar="JOB", help="every rank of this job on this node (see `dynprof ps`)")
    group.add_argument("--all", action="store_true", help="every agent on this node")


def add_attach_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attach",
        action="store_true",
        help="first start the agent in target processes that have none (with --pid or --job; see `dynprof attach`)",
    )


# -- target selection ------------------------------------------------------------------------
def select_workers(records: Sequence[AgentRecord]) -> list[AgentRecord]:
    """The training processes among ``records``.

    Within one job, when some processes know their rank, only those are kept (a launcher
    such as torchrun's parent has none); a process whose parent is a kept process of the
    same rank (a DataLoader worker, say) is dropped.
    """
    by_job: dict[str | None, list[AgentRecord]] = {}
    for r in records:
        by_job.setdefault(r.job_id, []).append(r)
    kept: list[AgentRecord] = []
    for group in by_job.values():
        if any(r.rank is not None for r in group):
            group = [r for r in group if r.rank is not None]
        pids = {r.pid: r for r in group}
        kept.extend(r for r in group if not (r.ppid in pids and pids[r.ppid].rank == r.rank))
    kept.sort(key=lambda r: (r.job_id or "", r.rank if r.rank is not None else -1, r.pid))
    return kept


def refresh_records(records: list[AgentRecord], timeout: float = 1.0) -> list[AgentRecord]:
    """Update rank, world size and job from each agent's live status (a launcher such as
    torch.multiprocessing.spawn sets RANK after the process started); unreachable agents keep
    what their record says."""
    from dynprof.client import AgentClient

    statuses = parallel(lambda r: AgentClient.for_record(r, timeout=timeout).status(), records)
    for record, st in zip(records, statuses):
        if isinstance(st, Exception):
            continue
        record.rank = st.rank if st.rank >= 0 else None
        record.world_size = st.world_size if st.world_size >= 0 else None
        record.job_id = st.job_id or None
    return records


def resolve_agents(args: argparse.Namespace) -> list[AgentRecord]:
    """Agent records for --pid / --job / --all, with a precise error when none match.

    With ``--attach``, processes named by --pid or found by --job that have no agent get one first.
    """
    if getattr(args, "attach", False):
        attach_first(args)
    if getattr(args, "pid", None):
        records = []
        for pid in args.pid:
            errors.probe_pid(pid)
            record = read_record(pid)
            if record is None or not record.is_alive():
                raise errors.NoAgent(
                    f"process {pid} has no dynprof agent{_describe_pid(pid)}",
                    help=f"Attach one: `dynprof attach {pid}`, or add --attach to this command; or "
                    + errors.LAUNCH_WITH_AGENT_HELP,
                )
            records.append(record)
        return records
    records = refresh_records(list_records())
    if getattr(args, "job", None):
        matching = [r for r in records if r.job_id == args.job]
        if not matching:
            jobs = sorted({r.job_id or "-" for r in records})
            raise errors.DynprofError(
                f"no agent of job {args.job!r} on this node",
                help=(
                    f"Attach agents to its processes: `dynprof attach --job {args.job}`, or add --attach to this "
                    "command. " + (("Jobs with agents here: " + ", ".join(jobs)) if jobs else "")
                ).strip(),
            )
        return select_workers(matching)
    if not records:
        raise errors.NoAgent("no dynprof agent is running on this node (for this user)")
    return select_workers(records)


def attach_first(args: argparse.Namespace) -> None:
    """``--attach``: start the agent in the targets that have none (a no-op for the others)."""
    from dynprof.attach import AttachOptions, attach, existing_agent
    from dynprof.attach._discover import find_job_processes
    from dynprof.cli.attach import describe

    if getattr(args, "all", False):
        raise errors.UsageError("--attach needs --pid or --job", help="--all selects processes that have agents.")
    if getattr(args, "pid", None):
        todo, settings = list(args.pid), {}
    elif getattr(args, "job", None):
        search = find_job_processes(args.job)
        todo, settings = [p.pid for p in search.found], {"DYNPROF_JOB_ID": args.job}
    else:
        return
    for pid in todo:
        errors.probe_pid(pid)
        if existing_agent(pid) is not None:
            continue
        result = attach(pid, AttachOptions(settings=dict(settings)))
        print(f"dynprof: {describe(result)}", file=sys.stderr)


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        return ""
    return f" ({comm})"


def parallel(fn: Any, items: Iterable[Any], max_workers: int = 32) -> list[Any]:
    """Run ``fn`` over ``items`` in threads; each result is a value or the exception raised."""
    items = list(items)
    if not items:
        return []

    def wrapped(item: Any) -> Any:
        try:
            return fn(item)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        return list(pool.map(wrapped, items))


# -- output -------------------------------------------------------------------------------------
def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


class Progress:
    """A one-line progress display on stderr (rewritten in place on a terminal)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = ""
        self._last_print = 0.0

    def update(self, text: str) -> None:
        if not self.enabled or text == self._last:
            return
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif now - self._last_print >= 1.0:
            sys.stderr.write(text + "\n")
            self._last_print = now
        self._last = text

    def done(self) -> None:
        if self.enabled and self.tty and self._last:
            sys.stderr.write("\n")
        self._last = ""
