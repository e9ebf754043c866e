"""Agent extension: every thread's Python stack, read from inside (``dump_stacks``).

The fallback of ``dynprof stacks`` when reading the process from outside is not permitted
(no CAP_SYS_PTRACE, Yama ptrace_scope, a non-dumpable process). Runs on the agent's server
thread, so it needs the GIL for the few milliseconds it takes; a process whose main thread
holds the GIL in C code cannot answer (the CLI times out and says so).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynprof.agent._server import CommandError
from dynprof.proto import pb

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent


def checked_output_path(text: str) -> Path:
    """An output path named by a client: absolute, a new file, in a directory of our own uid."""
    path = Path(text)
    if not path.is_absolute() or path.name in ("", ".", "..") or ".." in path.parts:
        raise CommandError(pb.INVALID_ARGUMENT, f"output path {text!r} must be an absolute file path")
    try:
        st = os.stat(path.parent, follow_symlinks=False)
    except OSError as exc:
        raise CommandError(pb.INVALID_ARGUMENT, f"output directory {path.parent} is not usable: {exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise CommandError(pb.INVALID_ARGUMENT, f"output directory {path.parent} is not a directory of this user")
    if os.path.lexists(path):
        raise CommandError(pb.INVALID_ARGUMENT, f"output file {path} exists already")
    return path


def install(agent: Agent) -> None:
    def dump_stacks(msg: Any) -> tuple[str, Any]:
        from collectors.stacks import KIND, capture_in_process

        stacks = capture_in_process(locals=bool(msg.locals))
        if not msg.all_threads:
            stacks.threads = [t for t in stacks.threads if t.main] or stacks.threads[:1]
        ident = agent.identity
        stacks.rank, stacks.job, stacks.host = ident.rank, ident.job_id, ident.host
        summary = {"threads": len(stacks.threads)}
        if msg.output_path:
            path = checked_output_path(msg.output_path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as fh:
                json.dump(stacks.to_dict(), fh)
            return "artifact", pb.ArtifactWritten(path=str(path), status="complete", summary_json=json.dumps(summary))
        from collectors.stacks import write_request_artifact
        from dynprof.store import ArtifactStore

        writer = ArtifactStore().create(
            KIND,
            job=ident.job_id,
            host=ident.host,
            rank=ident.rank,
            options={"method": "agent", "locals": bool(msg.locals)},
        )
        art = writer.finish("complete", summary=write_request_artifact(writer, [stacks], {}))
        return "artifact", pb.ArtifactWritten(path=str(art.path), status="complete", summary_json=json.dumps(summary))

    agent.handlers["dump_stacks"] = dump_stacks
