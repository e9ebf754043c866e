"""Files and directories reached without following a link.

The artifact store (:mod:`dynprof.store`) is a tree that other users, or a process of the same
user, may have planted links in. The helpers here walk, create and delete in such a tree relative
to directory descriptors: each directory is opened relative to its parent with ``O_NOFOLLOW``
(:data:`DIR_FLAGS`), files are created new (``O_EXCL``) and never through a link, deletions and
stats are relative to a descriptor and never follow the last link. A directory is entered only
when it belongs to the tree's owner and is not open to writes by others (:func:`dir_problem`).

They know nothing of what the tree holds: the store decides which names and levels mean what.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Flags that open a directory, refusing a link (and anything that is not a directory)."""


def make_dirs(path: Path, mode: int) -> None:
    """Create ``path`` and its missing parents, each with exactly ``mode`` (umask aside).
    Directories that already exist are left as they are."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)


def disk_usage(path: Path, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of the regular files directly in ``path`` (but those named in ``exclude``), links
    not followed: what is on disk. Entries that cannot be looked at count nothing."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                if entry.name not in exclude and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


MAX_DISK_DEPTH = 32
"""Levels :func:`disk_blocks` descends, at most (a store is 5 deep, an artifact a few more)."""


def disk_blocks(dir_fd: int, name: str, seen: set[tuple[int, int]] | None = None, depth: int = MAX_DISK_DEPTH) -> int:
    """Bytes on disk (``st_blocks * 512``) of the entry ``name`` of ``dir_fd`` (``"."``: that
    directory) and, a directory, of everything below it: files, directories and links themselves,
    never followed. An inode met again (a hard link, in ``seen``) counts once; below ``depth``
    levels a directory counts itself only; entries that cannot be looked at count nothing."""
    seen = set() if seen is None else seen
    st = lstat_at(dir_fd, name)
    if st is None or (st.st_dev, st.st_ino) in seen:
        return 0
    seen.add((st.st_dev, st.st_ino))
    total = st.st_blocks * 512
    if not stat.S_ISDIR(st.st_mode) or depth <= 0:
        return total
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return total
    try:
        for entry, _, _ in entries(fd):
            total += disk_blocks(fd, entry, seen, depth - 1)
    finally:
        os.close(fd)
    return total


def dir_problem(st: os.stat_result, owner: int) -> str | None:
    """Why a directory may not be part of a tree owned by ``owner`` (None: it may)."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != owner:
        return f"owned by uid {st.st_uid}, not by the store's owner (uid {owner})"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def child_dir(dir_fd: int, name: str, owner: int) -> int | None:
    """A descriptor of the subdirectory ``name`` if it belongs to the tree: a directory (never
    reached through a link), the owner's, not writable by others. None otherwise, or if it vanished."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        ok = dir_problem(os.fstat(fd), owner) is None
    except OSError:
        ok = False
    if not ok:
        os.close(fd)
        return None
    return fd


def entries(dir_fd: int) -> list[tuple[str, bool, bool]]:
    """``(name, is a directory, is a link)`` of each entry, links not followed, sorted by name;
    entries that vanish while they are looked at are left out."""
    found = []
    try:
        with os.scandir(dir_fd) as it:
            for entry in it:
                try:
                    found.append((entry.name, entry.is_dir(follow_symlinks=False), entry.is_symlink()))
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(found)


def walk(
    dir_fd: int, owner: int, depth: int, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, bool, bool, int]]:
    """Each entry ``depth`` levels below ``dir_fd`` (``A/B/.../NAME``) as ``(parents, name, is a
    directory, is a link, descriptor of its parent directory)``. Only directories that belong to
    the tree are entered (:func:`child_dir`); hidden ones above that level are not."""
    for name, is_dir, is_link in entries(dir_fd):
        if len(prefix) == depth:
            yield prefix, name, is_dir, is_link, dir_fd
            continue
        if not is_dir or is_link or name.startswith("."):
            continue
        fd = child_dir(dir_fd, name, owner)
        if fd is None:
            continue
        try:
            yield from walk(fd, owner, depth, (*prefix, name))
        finally:
            os.close(fd)


def rmtree_at(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` of ``dir_fd`` and everything in it, relative to directory
    descriptors: a link met on the way is removed, never followed; a ``name`` that is a link is
    left alone. Errors are ignored (what cannot be removed stays)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for entry, is_dir, is_link in entries(fd):
            if is_dir and not is_link:
                rmtree_at(fd, entry)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=fd)
    except RecursionError:
        return
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` relative to ``dir_fd`` (a link is itself); None when it cannot be."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def write_new_file(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """Create ``name`` in ``dir_fd``: new (``O_EXCL``), never through a link, exactly ``mode``."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), mode)
        fh.write(data)


def unsafe_ancestor(path: Path) -> str | None:
    """Why a directory above ``path`` lets another user replace it (None: none does). An
    ancestor must be ours or root's, and one that others may write must be sticky (``/tmp``)
    or ours."""
    uid = os.geteuid()
    for parent in Path(os.path.realpath(path)).parents:
        try:
            st = os.lstat(parent)
        except OSError:
            continue
        if st.st_uid not in (uid, 0):
            return f"{parent} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX and st.st_uid != uid:
            return f"{parent} is writable by others"
    return None
