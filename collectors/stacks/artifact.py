"""A stacks artifact: every process's full dump (``<stem>.json``, ``<stem>.txt``) and the merged
view (``merged.json``, a stacks document whose process rows name their dump's ``file`` stem, and
``merged.txt``)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from collectors.stacks.merge import Source, merge
from collectors.stacks.model import HANG_KIND, Budget, ProcessStacks, Stacks, headline, read_document
from collectors.stacks.render import render_merged, render_process
from dynprof.errors import ArtifactError


def process_file_stem(p: ProcessStacks) -> str:
    return (f"rank{p.rank}-" if p.rank is not None else "") + f"pid{p.pid}"


def unique_file_stems(processes: Sequence[ProcessStacks]) -> list[str]:
    """A file name per process; the same rank or pid on two nodes gets its host added."""
    stems: list[str] = []
    used: set[str] = set()
    for i, p in enumerate(processes):
        stem = process_file_stem(p)
        if stem in used:
            host = re.sub(r"[^A-Za-z0-9._-]", "_", p.host or "")[:64]
            stem = f"{stem}-{host}-{i}" if host else f"{stem}-{i}"
        used.add(stem)
        stems.append(stem)
    return stems


def write_request_artifact(writer: Any, processes: Sequence[ProcessStacks], failures: dict[str, str]) -> dict[str, Any]:
    """Fill an artifact writer with every process's dump and the merged view; return the summary."""

    merged = merge([Source(Stacks(list(processes), failures=dict(failures)))])
    doc = merged.to_json()
    for p, row, stem in zip(merged.processes, doc["processes"], unique_file_stems(merged.processes)):
        row["file"] = stem
        writer.write_json(f"{stem}.json", p.to_json())
        writer.write_text(f"{stem}.txt", render_process(p) + "\n")
    writer.write_json("merged.json", doc)
    writer.write_text("merged.txt", render_merged(merged.processes, merged.groups))
    return {
        "processes": len(merged.processes),
        "failed": len(merged.failures),
        "groups": len(merged.groups),
        "lines": [f"{g.labels}: {g.headline()}" for g in merged.groups],
        "methods": sorted({p.method for p in merged.processes}),
    }


def _process_from(directory: Path, name: str, budget: Budget) -> ProcessStacks:
    from dynprof.untrusted import read_json_in

    data = read_json_in(directory, name)
    try:
        return ProcessStacks.from_json(data, budget)
    except ArtifactError as exc:
        raise ArtifactError(f"{name} in {directory}: {exc.message}") from None


def load_processes(directory: Path) -> list[ProcessStacks]:
    """The processes of a stacks artifact, every thread. Its files are untrusted: only plain
    names inside ``directory`` are read (an entry naming ``../x`` or ``/etc/x`` is refused),
    never through a link, with the bounds of :mod:`collectors.stacks.model`."""
    from dynprof.untrusted import check_name, open_in

    directory = Path(directory)
    budget = Budget()
    if os.path.lexists(directory / "merged.json"):
        with open_in(directory, "merged.json") as fh:
            try:
                rows = read_document(fh, budget).processes
            except ArtifactError as exc:
                raise ArtifactError(f"merged.json in {directory}: {exc.message}") from None
        processes = []
        for row in rows:
            if row.file is None:
                raise ArtifactError(f"merged.json in {directory}: an entry without a file name")
            processes.append(_process_from(directory, check_name(f"{row.file}.json"), budget))
        return processes
    if os.path.lexists(directory / "stacks.json"):
        return [_process_from(directory, "stacks.json", budget)]
    return []


def render_artifact(artifact: Any) -> tuple[dict[str, Any], str]:
    """Renderer for ``dynprof show`` (kinds ``stacks`` and ``hang``): the artifact's files, read back and rendered."""
    processes = load_processes(Path(artifact.path))
    groups = merge([Source(Stacks(processes))]).groups
    summary: dict[str, Any] = {"processes": len(processes), "groups": [g.to_json() for g in groups]}
    if artifact.kind == HANG_KIND:
        m = artifact.manifest.get("summary") or {}
        text = (
            f"no optimizer step for {m.get('stalled_for_s', '?')} s after step {m.get('step', '?')}"
            f" (timeout {m.get('timeout_s', '?')} s)\n\n"
        )
        text += "".join(
            f"main thread {headline(main.frames)}\n\n" for p in processes if (main := p.main_thread()) is not None
        )
        text += "\n\n".join(render_process(p) for p in processes)
        summary.update({k: m.get(k) for k in ("step", "stalled_for_s", "timeout_s", "dump")})
        return summary, text
    return summary, render_merged(processes, groups)
