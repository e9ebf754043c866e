"""Where dynprof keeps its per-user runtime state and its artifacts.

* Runtime directory (sockets, registration records, agent logs): ``DYNPROF_RUN_DIR``, else
  ``$XDG_RUNTIME_DIR/dynprof``, else ``/tmp/dynprof-<uid>``. Always mode 0700 and owned by us.
* Artifact directory: ``DYNPROF_ARTIFACT_DIR``, else ``$XDG_DATA_HOME/dynprof/artifacts``,
  else ``~/.local/share/dynprof/artifacts``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dynprof.errors import DynprofError, PermissionDenied

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


def run_dir(create: bool = True) -> Path:
    env = os.environ.get("DYNPROF_RUN_DIR")
    if env:
        path = Path(env)
    elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "dynprof"
    else:
        path = Path(f"/tmp/dynprof-{os.getuid()}")
    if create:
        ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700 and check that it is ours and not open to others."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except PermissionError:
        raise PermissionDenied(
            f"cannot create the dynprof runtime directory {path}",
            help="Set DYNPROF_RUN_DIR to a directory you own.",
        ) from None
    except (FileExistsError, NotADirectoryError):
        raise DynprofError(
            f"cannot use {path} as a dynprof runtime directory: it, or a directory above it, is a file",
            help="Remove the file, or set DYNPROF_RUN_DIR to a directory you own.",
        ) from None
    except OSError as exc:
        raise DynprofError(
            f"cannot create the dynprof runtime directory {path}: {exc.strerror or exc}",
            help="Set DYNPROF_RUN_DIR to a directory you own on a writable filesystem.",
        ) from None
    try:
        st = path.lstat()
    except OSError as exc:
        raise DynprofError(f"cannot use the dynprof runtime directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise DynprofError(f"{path} exists and is not a directory", help="Remove it or set DYNPROF_RUN_DIR.")
    if st.st_uid != os.getuid():
        raise PermissionDenied(
            f"the dynprof runtime directory {path} belongs to uid {st.st_uid}, not to you ({os.getuid()})",
            help="Set DYNPROF_RUN_DIR to a directory you own.",
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def agents_dir(create: bool = True) -> Path:
    path = run_dir(create) / "agents"
    if create:
        ensure_private_dir(path)
    return path


def logs_dir(create: bool = True) -> Path:
    path = run_dir(create) / "logs"
    if create:
        ensure_private_dir(path)
    return path


def artifact_dir() -> Path:
    env = os.environ.get("DYNPROF_ARTIFACT_DIR")
    if env:
        return Path(env)
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "dynprof" / "artifacts"
