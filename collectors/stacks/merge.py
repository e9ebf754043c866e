"""THE merge of stacks: many processes, of one node or of many, given as they were read, as the
nodes' answers or as files, become one :class:`~collectors.stacks.model.Stacks`, its processes
grouped by the stack of their main thread.

``dynprof stacks`` on one node, ``dynprof stacks --hosts`` over the nodes' answers and
``dynprof stacks --merge`` over files all call :func:`merge`; the artifact's merged view is
made by it too. For each group other than the largest, the merge finds the frame where it
departs from the largest one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.stacks.model import MAX_PROCESSES, Frame, Group, ProcessStacks, Stacks, sort_key
from dynprof.errors import ArtifactError


@dataclass
class Source:
    """One input of a merge: a node's processes as read there, a node's answer or a file
    (:func:`collectors.stacks.model.from_json`, :func:`~collectors.stacks.model.read_document`).

    ``host`` names the node of the processes that do not name theirs (a file's name says it);
    ``node`` names the node of every process, whatever they say (the fan-out's label for the
    sidecar that answered: two sidecars on one host are two nodes). Failures get the node named
    (``rank 3 (pid 42) on node-5``) where they do not name one already."""

    stacks: Stacks
    host: str | None = None
    node: str | None = None


def several_hosts(processes: Sequence[ProcessStacks]) -> bool:
    """Processes of more than one node: labels then name each rank's host."""
    return len({p.host for p in processes}) > 1


def merge(sources: Iterable[Source], by_host: bool | None = None) -> Stacks:
    """The processes of every source, each (host, pid) once, and their failures, grouped over
    all of them. ``by_host`` (default: when the processes are of several hosts) makes labels
    name each rank's host. Over :data:`MAX_PROCESSES` processes in all is refused."""
    processes: list[ProcessStacks] = []
    failures: dict[str, str] = {}
    seen: set[tuple[str | None, int]] = set()
    truncated = 0
    for source in sources:
        where = source.node or source.host
        for who, why in source.stacks.failures.items():
            failures[f"{who} on {where}" if where and " on " not in who else who] = why
        truncated += source.stacks.truncated
        for p in source.stacks.processes:
            if source.node is not None:
                p.host = source.node
            elif p.host is None:
                p.host = source.host
            if (p.host, p.pid) in seen:
                continue  # the same answer given twice
            seen.add((p.host, p.pid))
            processes.append(p)
            if len(processes) > MAX_PROCESSES:
                raise ArtifactError(f"over {MAX_PROCESSES} processes in all: refused")
    named = several_hosts(processes) if by_host is None else by_host
    return Stacks(processes, group_processes(processes, by_host=named), failures, truncated)


def stack_key(frames: Sequence[Frame]) -> tuple[tuple[str, str, int], ...]:
    return tuple(f.key() for f in frames)


def _divergence(frames: Sequence[Frame], reference: Sequence[Frame]) -> tuple[Frame | None, Frame | None]:
    """The first frame, walking from the outermost, where ``frames`` differs from ``reference``."""
    a, b = list(reversed(frames)), list(reversed(reference))
    for i in range(max(len(a), len(b))):
        fa = a[i] if i < len(a) else None
        fb = b[i] if i < len(b) else None
        if fa is None or fb is None or fa.key() != fb.key():
            return fa, fb
    return None, None


def group_processes(processes: Iterable[ProcessStacks], by_host: bool = False) -> list[Group]:
    """Group processes by identical main-thread stack, largest group first (ties: lowest rank).
    With ``by_host`` (processes of several nodes), labels name each member's host."""
    buckets: dict[tuple[tuple[str, str, int], ...], list[ProcessStacks]] = {}
    frames_of: dict[tuple[tuple[str, str, int], ...], list[Frame]] = {}
    for p in processes:
        main = p.main_thread()
        frames = main.frames if main is not None else []
        key = stack_key(frames)
        buckets.setdefault(key, []).append(p)
        frames_of.setdefault(key, frames)

    def order(item: tuple[Any, list[ProcessStacks]]) -> tuple[int, int, int]:
        members = item[1]
        first = min(members, key=sort_key)
        return (-len(members), first.rank if first.rank is not None else 1 << 30, first.pid)

    groups = [
        Group(members=sorted(m, key=sort_key), frames=frames_of[k], by_host=by_host)
        for k, m in sorted(buckets.items(), key=order)
    ]
    if len(groups) > 1:
        reference = groups[0]
        for g in groups[1:]:
            g.outlier = len(g.members) < len(reference.members)
            g.diverges_at, g.reference_at = _divergence(g.frames, reference.frames)
    return groups
