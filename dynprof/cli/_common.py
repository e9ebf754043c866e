"""Pieces shared by the subcommands: option groups, target selection, output."""

from __future__ import annotations

import argparse
import contextvars
import math
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dynprof import errors, jsontext, roles
from dynprof.registry import AgentRecord, list_records, read_record
from dynprof.units import human_age as human_age  # re-exported for the subcommands
from dynprof.units import human_bytes as human_bytes

# -- argument validators ------------------------------------------------------------------------
# Every number a person types is checked at the edge: finite, in range, or a usage error (exit 2)
# naming the option, before anything is sent to a process. The bounds are documented in
# docs/cli.md through the help texts.
MAX_SECONDS = 86_400.0  # one day: no wait, trace or timeout dynprof offers is longer
MAX_TRACE_STEPS = 1_000_000  # well inside the wire's uint32
MAX_STEP_NUMBER = 2**63 - 1  # an optimizer step number (the wire carries uint64)
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_HISTORY_EVENTS = 10**9  # CUDA allocator history entries


def _number_text(text: str) -> str:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return ascii(shown)[1:-1]


def parse_int(text: str, low: int, high: int, what: str = "an integer") -> int:
    try:
        value = int(text.strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not {what}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"{value if len(str(value)) <= 40 else _number_text(text)} is out of range ({low}..{high})"
        )
    return value


def parse_float(text: str, low: float, high: float, low_open: bool = True, what: str = "a number") -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not a finite number")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise argparse.ArgumentTypeError(f"{value:g} is out of range {bracket}{low:g}, {high:g}]")
    return value


def bounded_int(low: int, high: int) -> Any:
    """An argparse ``type``: a base-10 integer in ``low..high``."""

    def parse(text: str) -> int:
        return parse_int(text, low, high)

    parse.__name__ = "integer"
    return parse


def positive_float(high: float = MAX_SECONDS) -> Any:
    """An argparse ``type``: a finite number in ``(0, high]``."""

    def parse(text: str) -> float:
        return parse_float(text, 0.0, high)

    parse.__name__ = "number"
    return parse


def nonnegative_float(high: float) -> Any:
    """An argparse ``type``: a finite number in ``[0, high]``."""

    def parse(text: str) -> float:
        return parse_float(text, 0.0, high, low_open=False)

    parse.__name__ = "number"
    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a finite positive number of seconds, at most a day."""
    return parse_float(text, 0.0, MAX_SECONDS, what="a number of seconds")


MAX_PATH_BYTES = 4095  # PATH_MAX, less the terminating NUL


def path_arg(text: str) -> str:
    """An argparse ``type``: a file name the system can take (no NUL byte, not empty, not
    longer than PATH_MAX). Whether it exists is for the command to say."""
    if not text:
        raise argparse.ArgumentTypeError("empty file name")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r}: a file name cannot hold a NUL byte")
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r}: file name longer than {MAX_PATH_BYTES} bytes")
    return text


def host_arg(text: str) -> str:
    """An argparse ``type``: an IP address or a host name (RFC 1123 labels), nothing else."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if (
        not text
        or len(text) > 253
        or not all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label) for label in labels)
    ):
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not an IP address or a host name")
    return text


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 1..65535."""
    return parse_int(text, 1, 65535, what="a port number")


# -- option groups -----------------------------------------------------------------------------
def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def parse_pid(text: str) -> int:
    """An argparse ``type``: one process id, a base-10 integer in ``1..MAX_PID``."""
    part = text.strip()
    try:
        pid = int(part, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_number_text(part)!r} is not a pid") from None
    if not 0 < pid <= MAX_PID:
        raise argparse.ArgumentTypeError(f"{pid if len(part) <= 40 else _number_text(part)} is not a valid pid")
    return pid


parse_pid.__name__ = "pid"


def parse_pids(text: str) -> list[int]:
    pids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        pids.append(parse_pid(part))
    if not pids:
        raise argparse.ArgumentTypeError("no pid given")
    return pids


def add_targets(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--pid", type=parse_pids, metavar="PID[,PID...]", help="target process ids")
    group.add_argument(
        "--job",
        metavar="JOB",
        help="the trainers of this job on this node: every rank, no launcher (ROLE in `dynprof ps`)",
    )
    group.add_argument("--all", action="store_true", help="every agent on this node")


def add_attach_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attach",
        action="store_true",
        help="first start the agent in target processes that have none (with --pid or --job; see `dynprof attach`)",
    )


# -- target selection ------------------------------------------------------------------------
def select_workers(records: Sequence[AgentRecord]) -> list[AgentRecord]:
    """The training processes among ``records``, job by job (see ``dynprof.roles``): the
    trainers, or where none is known to train yet, the processes that are neither launchers
    (torchrun, accelerate launch, a Python wrapper of the script) nor DataLoader workers."""
    by_job: dict[str | None, list[AgentRecord]] = {}
    for r in records:
        by_job.setdefault(r.job_id, []).append(r)
    kept: list[AgentRecord] = []
    for group in by_job.values():
        kept.extend(roles.targets(group))
    kept.sort(key=lambda r: (r.job_id or "", r.rank if r.rank is not None else -1, r.pid))
    return kept


def refresh_records(records: list[AgentRecord], timeout: float = 1.0) -> list[AgentRecord]:
    """Update rank, world size, job and role from each agent's live status (a launcher such as
    torch.multiprocessing.spawn sets RANK after the process started; a process becomes a
    trainer at its first step); unreachable agents keep what their record says."""
    from dynprof.client import AgentClient

    statuses = parallel(lambda r: AgentClient.for_record(r, timeout=timeout).status(), records)
    for record, st in zip(records, statuses):
        if isinstance(st, Exception):
            continue
        record.rank = st.rank if st.rank >= 0 else None
        record.world_size = st.world_size if st.world_size >= 0 else None
        record.job_id = st.job_id or None
        record.role = st.role if st.role in roles.ROLES else record.role
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
        chosen = select_workers(matching)
        _note_left_out(args.job, matching, chosen)
        return chosen
    if not records:
        raise errors.NoAgent("no dynprof agent is running on this node (for this user)")
    return select_workers(records)


_ROLE_NOTES = {
    roles.LAUNCHER: "a launcher",
    roles.WORKER: "a DataLoader worker",
    roles.OTHER: "no optimizer step yet",
    roles.TRAINER: "a trainer",
}


def _note_left_out(job: str, matching: Sequence[AgentRecord], chosen: Sequence[AgentRecord]) -> None:
    """Say which processes of the job --job does not target, and why (their role)."""
    kept = {r.pid for r in chosen}
    left = [r for r in matching if r.pid not in kept]
    if not left:
        return
    role_of = roles.job_roles(matching)
    print(
        f"dynprof: job {printable(job)}: not targeting {len(left)} process(es) that are not trainers: "
        + ", ".join(f"pid {r.pid} ({_ROLE_NOTES[role_of[r.pid]]})" for r in left),
        file=sys.stderr,
    )


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

    # Each call runs in a copy of the caller's context, so a sidecar action's captured output
    # (dynprof.sidecar.actions) follows its worker threads.
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items))) as pool:
        futures = [pool.submit(contextvars.copy_context().run, wrapped, item) for item in items]
        return [f.result() for f in futures]


# -- output -------------------------------------------------------------------------------------
def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (RFC 8259) on stdout: NaN and infinities, which some readers
    refuse (``jq``, browsers' JSON.parse), are written as null."""
    print(jsontext.dumps(obj, indent=2, default=str))


# Characters that must not reach a terminal raw: C0/C1 controls (escape sequences, carriage
# returns, backspaces), bidirectional overrides (text that reads differently from what it is)
# and lone surrogates (undecodable bytes, which would also fail to encode).
_BIDI = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A)) | {0x200E, 0x200F, 0x061C}


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` safe to show on a terminal: control characters and the like as ``\\xNN`` escapes.

    Job ids, command lines and manifests come from other processes and from files: whatever
    they hold must not move the cursor, recolour or clear the screen of whoever runs dynprof."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        code = ord(ch)
        if ch.isprintable() and code not in _BIDI:
            out.append(ch)
        elif ch == " ":
            out.append(ch)
        else:
            out.append(_escape_char(ch))
    return "".join(out)


def printable_lines(text: str) -> str:
    """Like :func:`printable`, line by line: newlines kept, everything else escaped."""
    return "\n".join(printable(line) for line in text.split("\n"))


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[printable(h) for h in headers]] + [[("" if c is None else printable(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


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
