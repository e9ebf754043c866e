"""Agent extension: every thread's Python stack, read from inside (``dump_stacks``).

The fallback of ``dynprof stacks`` when reading the process from outside is not permitted
(no CAP_SYS_PTRACE, Yama ptrace_scope, a non-dumpable process). Runs on the agent's server
thread, so it needs the GIL for the few milliseconds it takes; a process whose main thread
holds the GIL in C code cannot answer (the CLI times out and says so).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynprof import untrusted
from dynprof.agent._server import CommandError
from dynprof.errors import ArtifactError
from dynprof.paths import run_dir
from dynprof.proto import pb
from dynprof.store import ArtifactStore, open_temporary_dir

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent


OUTPUT_HELP = (
    "Name a file in a directory of dynprof's own: under the dynprof run directory "
    "(DYNPROF_RUN_DIR), or in the artifact being written in a dynprof store; or name no path "
    "and the agent writes an artifact in its store."
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(message: str) -> CommandError:
    return CommandError(pb.INVALID_ARGUMENT, message, OUTPUT_HELP)


def _run_dir_fd(directory: Path) -> int | None:
    """A descriptor of ``directory`` if it lies under this user's dynprof run directory, every
    directory from there down ours, not writable by others, and none reached through a link."""
    base = Path(os.path.abspath(run_dir(create=False)))
    if directory != base and base not in directory.parents:
        return None
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for part in (*directory.relative_to(base).parts, None):
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise _refuse(f"output directory {directory} is not a private directory of this user: refused")
            if part is None:
                return fd
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        raise _refuse(
            f"output directory {directory} is reached through a link or is not a directory ({exc.strerror}): refused"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return None  # pragma: no cover - the loop returns


def open_output(text: str) -> tuple[int, Path]:
    """Create the output file a client named: a new file (``O_EXCL``), mode 0600, never through
    a link, and only in dynprof's own places (the run directory, an artifact being written in
    a dynprof store). Returns its descriptor and path; anything else is ``INVALID_ARGUMENT``."""
    path = Path(text)
    if not path.is_absolute() or ".." in path.parts:
        raise _refuse(f"output path {text[:200]!r} must be an absolute file path")
    try:
        untrusted.check_name(path.name)
    except ArtifactError:
        raise _refuse(f"output path {text[:200]!r} does not name a file") from None
    directory = Path(os.path.abspath(path.parent))
    dir_fd = _run_dir_fd(directory)
    if dir_fd is None:
        dir_fd = open_temporary_dir(directory)
    if dir_fd is None:
        raise _refuse(f"output path {text[:200]!r} is outside dynprof's own directories: refused")
    try:
        fd = os.open(path.name, _NEW_FILE_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        raise _refuse(f"output file {text[:200]!r} exists already: refused") from None
    except OSError as exc:
        raise _refuse(f"cannot create the output file {text[:200]!r}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    os.fchmod(fd, 0o600)
    return fd, directory / path.name


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
            fd, path = open_output(msg.output_path)
            with os.fdopen(fd, "w") as fh:
                json.dump(stacks.to_json(), fh)
            return "artifact", pb.ArtifactWritten(path=str(path), status="complete", summary_json=json.dumps(summary))
        from collectors.stacks import write_request_artifact

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
