"""Text renderers of stacks: one process's dump, the merged view, and a stacks (or hang)
artifact for ``dynprof show``. Each line is made one printable line
(:func:`dynprof.safetext.one_line`): a newline or an escape sequence in a frame's name, a
thread's name or a host is shown escaped, never as a line of its own."""

from __future__ import annotations

from collections.abc import Sequence

from collectors.stacks.merge import group_processes
from collectors.stacks.model import Group, ProcessStacks, ThreadStack
from dynprof.safetext import one_line


def render_process(p: ProcessStacks) -> str:
    """One process's dump: every thread, innermost frame first."""
    where = f" on {p.host}" if p.host else ""
    who = f"{p.label} (pid {p.pid}{where})" if p.rank is not None else f"pid {p.pid}{where}"
    head = f"{who} read with {p.method}{' (native frames)' if p.native else ''}"
    lines = [head]
    if p.fallback_reason:
        lines.append(f"  note: {p.fallback_reason}")
    for note in p.notes:
        lines.append(f"  note: {note}")
    for t in p.threads:
        flags = []
        if t.main:
            flags.append("main")
        if t.holds_gil:
            flags.append("holds the GIL")
        if t.active is False:
            flags.append("idle")
        name = f' "{t.name}"' if t.name else ""
        lines.append(f"Thread {t.tid}{name}" + (f" ({', '.join(flags)})" if flags else ""))
        if not t.frames:
            lines.append("    (no frames)")
        for f in t.frames:
            lines.append(f"    {f.where()}")
            for k, v in (f.locals or {}).items():
                lines.append(f"        {k} = {v}")
    return "\n".join(one_line(line) for line in lines)


def render_merged(
    processes: Sequence[ProcessStacks], groups: Sequence[Group] | None = None, max_frames: int = 40
) -> str:
    groups = list(groups) if groups is not None else group_processes(processes)
    methods = sorted({p.method for p in processes})
    native = any(p.native for p in processes)
    lines = [
        f"{len(processes)} process(es), {len(groups)} group(s) by main-thread stack"
        f" (read with {', '.join(methods)}{'; native frames' if native else ''}; innermost frame first)"
    ]
    lines.append("")
    for g in groups:
        text = f"{g.labels}: {g.headline()}"
        if g.outlier:
            text += "   <- outlier"
        lines.append(text)
    lines.append("")
    several = any(g.by_host for g in groups)

    def who(p: ProcessStacks) -> str:  # "rank 3 on node-5" where the processes are of several nodes
        return f"{p.label} on {p.host}" if several and p.host else p.label

    for i, g in enumerate(groups, 1):
        gil = [who(m) for m in g.members if (m.main_thread() or ThreadStack(0)).holds_gil]
        size = f"{len(g.members)} process{'es' if len(g.members) != 1 else ''}"
        title = f"== group {i}: {g.labels} ({size}){' -- outlier' if g.outlier else ''}"
        lines.append(title)
        if gil:
            lines.append(f"   main thread holds the GIL in: {', '.join(gil)}")
        if i > 1:
            if g.diverges_at is not None or g.reference_at is not None:
                mine = g.diverges_at.where() if g.diverges_at else "(its stack ends here)"
                ref = g.reference_at.where() if g.reference_at else "(its stack ends here)"
                lines.append(f"   differs from group 1 at: {mine}")
                lines.append(f"                group 1 is at: {ref}")
        shown = g.frames[:max_frames]
        for f in shown:
            lines.append(f"    {f.where()}")
        if len(g.frames) > max_frames:
            lines.append(f"    ... {len(g.frames) - max_frames} more frames")
        if not g.frames:
            lines.append("    (no frames: the main thread was not found or runs no code)")
        lines.append("")
    notes = [f"{who(p)}: read with {p.method} because {p.fallback_reason}" for p in processes if p.fallback_reason]
    if notes:
        lines.append("Notes:")
        lines.extend(f"  {n}" for n in notes)
    return "\n".join(one_line(line) for line in lines).rstrip() + "\n"
