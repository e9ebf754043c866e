"""The store itself (:class:`ArtifactStore`): its root (marked, ours, private), the layout
``<job>/<host>/<rank>/<kind>/<ID>`` under it, and what is done there: an artifact's directory
created (:meth:`ArtifactStore.create`), artifacts listed, found and removed, stale temporaries
swept and the size kept under its cap. See :mod:`dynprof.store` for the rules it keeps.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dynprof import __version__, nofollow, untrusted
from dynprof.errors import ArtifactError, StoreError
from dynprof.paths import artifact_dir
from dynprof.registry import pid_alive
from dynprof.store.artifact import Artifact, BadArtifact
from dynprof.store.manifest import MANIFEST, SCHEMA, SCHEMA_VERSION, utcnow_iso
from dynprof.store.owner import owner_tag, pid_namespace
from dynprof.store.writer import TEMP_MARKER, ArtifactWriter, TempDir, artifact_modes
from dynprof.units import parse_size

DEFAULT_MAX_BYTES = 20 * 1024**3
STALE_TMP_AFTER_S = 3600.0
"""A temporary directory this old is stale even when its writer's pid still runs."""
DEAD_OWNER_GRACE_S = 5.0
STORE_MARKER = ".dynprof-store"
"""The file at a store's root that says dynprof made (or adopted) it."""
STORE_SCHEMA = "dynprof.store"
STORE_FORMAT_VERSION = 1
LOCK = ".lock"
MAX_LEGACY_ENTRIES = 100_000
"""Entries looked at, at most, to tell whether an unmarked directory is an earlier dynprof's store."""
_ARTIFACT_LEVEL = 4
"""Directories above an artifact's: ``job/host/rank/kind``."""
_SAFE = re.compile(r"[^A-Za-z0-9_.@+-]")
_RANK_SEGMENT = re.compile(r"rank-?\d+|node")
_ARTIFACT_NAME = re.compile(r"\d{8}T\d{6}\.\d{6}Z-\d+(?:-\d+)?")
_TEMP_NAME = re.compile(r"\..+\.tmp")
NOT_A_STORE_HELP = (
    "Point DYNPROF_ARTIFACT_DIR at a directory of dynprof's own: a new path (dynprof creates it) or an empty directory."
)


class StoreRefused(ArtifactError):
    """A store root, or a directory in it, that dynprof will not use (not its, another user's)."""

    default_help = NOT_A_STORE_HELP


def safe_segment(segment: str) -> str:
    """``segment`` as one directory name of the store: characters other than letters, digits and
    ``_.@+-`` made ``_``, no leading or trailing dot, at most 100 characters."""
    segment = _SAFE.sub("_", segment).strip(".") or "_"
    return segment[:100]


def _looks_like_store(dir_fd: int, owner: int) -> bool:
    """Whether an unmarked directory is laid out as an earlier dynprof's store: every entry is
    ``job/host/rank/kind/ID`` (rank ``rankN`` or ``node``, ID a capture's name or a temporary),
    besides its ``.lock`` and the flight recorder's ``job/host/.flight-recorder``; directories
    only, no link, all the owner's; at least one rank level. Looks at a bounded number of entries."""
    budget = MAX_LEGACY_ENTRIES
    ranks = 0

    def walk(fd: int, depth: int) -> bool:
        nonlocal budget, ranks
        for name, is_dir, is_link in nofollow.entries(fd):
            budget -= 1
            if budget < 0:
                return False
            if depth == 0 and (name == LOCK or name.startswith(STORE_MARKER)):
                continue
            if is_link or not is_dir:
                return False
            if depth == 4:
                if not (_ARTIFACT_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name)):
                    return False
                continue
            if depth == 2:
                if not (_RANK_SEGMENT.fullmatch(name) or name == ".flight-recorder"):
                    return False
                ranks += 1
                if name == ".flight-recorder":
                    continue
            elif name.startswith("."):
                return False
            child = nofollow.child_dir(fd, name, owner)
            if child is None:
                return False
            try:
                if not walk(child, depth + 1):
                    return False
            finally:
                os.close(child)
        return True

    return walk(dir_fd, 0) and ranks > 0


class ArtifactStore:
    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else artifact_dir()
        if max_bytes is None:
            env = os.environ.get("DYNPROF_ARTIFACT_MAX_BYTES")
            max_bytes = parse_size(env) if env else DEFAULT_MAX_BYTES
        self.max_bytes = max_bytes

    # -- the root ----------------------------------------------------------------------------
    def _open_root(self, write: bool = False, create: bool = False) -> int | None:
        """A descriptor of the store's root, checked: dynprof's (its marker, or adopted now), not
        open to writes by others, and for writing ours. ``None`` when reading a store that does
        not exist yet. The root's own path may be a link (an operator's choice); nothing under it
        is followed."""
        root = self.root
        if write:
            unsafe = nofollow.unsafe_ancestor(root)
            if unsafe is not None:
                raise StoreRefused(
                    f"refused to write the artifact store {root}: {unsafe}, so another user could replace the store",
                    help="Point DYNPROF_ARTIFACT_DIR at a directory under one that only you (or root) may change.",
                )
            try:
                if create and not os.path.lexists(root):
                    # The store itself (and, for the default path, ~/.local/share/dynprof) is private.
                    nofollow.make_dirs(root, artifact_modes()[0])
            except OSError as exc:
                raise StoreError(f"cannot create the artifact store {root}: {exc.strerror}") from None
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if write:
                raise StoreError(f"the artifact store {root} does not exist (any more)") from None
            return None
        except NotADirectoryError:
            raise StoreRefused(f"the artifact store {root} is not a directory") from None
        except OSError as exc:
            raise StoreRefused(f"cannot open the artifact store {root}: {exc.strerror}") from None
        try:
            self._check_root(fd, write)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_root(self, fd: int, write: bool) -> None:
        root = self.root
        st = os.fstat(fd)
        uid = os.geteuid()
        if write and st.st_uid != uid:
            raise StoreRefused(
                f"the artifact store {root} belongs to uid {st.st_uid}, not to you (uid {uid}): refused",
                help="Point DYNPROF_ARTIFACT_DIR at a store of your own (a new path, or an empty directory).",
            )
        if self._read_marker(fd, st.st_uid) is None:
            names = [n for n, _, _ in nofollow.entries(fd) if n != LOCK and not n.startswith(STORE_MARKER)]
            if names and not _looks_like_store(fd, st.st_uid):
                shown = ", ".join(repr(n)[1:-1] for n in names[:5]) + (", ..." if len(names) > 5 else "")
                raise StoreRefused(
                    f"{root} is not a dynprof store: it holds other entries ({shown}) and no {STORE_MARKER} "
                    "marker, so dynprof will neither write nor delete anything in it"
                )
            if write:
                if not names and st.st_mode & 0o077 != artifact_modes()[0] & 0o077:
                    os.fchmod(fd, artifact_modes()[0])  # an empty directory adopted is private, as a new store is
                self._write_marker(fd)
                st = os.fstat(fd)
        if st.st_mode & 0o022:
            raise StoreRefused(
                f"the artifact store {root} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): refused",
                help=f"Make it private (chmod go-w {root}), or point DYNPROF_ARTIFACT_DIR at a store of your own.",
            )

    def _read_marker(self, fd: int, owner: int) -> dict[str, Any] | None:
        try:
            mfd = os.open(STORE_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreRefused(f"the store marker {self.root / STORE_MARKER} cannot be read: {exc.strerror}") from None
        with os.fdopen(mfd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner:
                raise StoreRefused(
                    f"the store marker {self.root / STORE_MARKER} is not a file of the store's owner: refused"
                )
            data = fh.read(4097)
        try:
            marker = untrusted.loads_json(data, str(self.root / STORE_MARKER)) if len(data) <= 4096 else None
        except ArtifactError:
            marker = None
        if not isinstance(marker, dict) or marker.get("schema") != STORE_SCHEMA:
            raise StoreRefused(
                f"the store marker {self.root / STORE_MARKER} is not dynprof's: refused",
                help="Remove it if this directory is a dynprof store, or "
                + NOT_A_STORE_HELP[0].lower()
                + NOT_A_STORE_HELP[1:],
            )
        return marker

    def _write_marker(self, fd: int) -> None:
        """Write the marker whole under a temporary name and link it into place, so a reader
        never sees half of it; a marker already there (another writer) is kept."""
        data = json.dumps(
            {
                "schema": STORE_SCHEMA,
                "version": STORE_FORMAT_VERSION,
                "created_at": utcnow_iso(),
                "dynprof_version": __version__,
            }
        ).encode()
        tmp = f"{STORE_MARKER}.{owner_tag()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        nofollow.write_new_file(fd, tmp, data + b"\n", artifact_modes()[1])
        try:
            os.link(tmp, STORE_MARKER, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp, dir_fd=fd)

    @contextlib.contextmanager
    def _root_fd(self, write: bool = False, create: bool = False) -> Iterator[int | None]:
        fd = self._open_root(write, create)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _kind_dir(self, parents: tuple[str, ...], *, create: bool = False) -> contextlib.AbstractContextManager[int]:
        """A descriptor of ``root/job/host/rank/kind`` for writing (see :meth:`_store_dir`)."""
        if len(parents) != 4:
            raise StoreError(f"not an artifact directory of the store: {'/'.join(parents)!r}")
        return self._store_dir(parents, create=create)

    @contextlib.contextmanager
    def _store_dir(self, parents: tuple[str, ...], *, create: bool = False) -> Iterator[int]:
        """A descriptor of ``root/PARENTS...`` for writing, each directory on the way checked
        (ours, not a link, not writable by others); with ``create``, made when missing."""
        if not parents or any(p in ("", ".", "..") or "/" in p for p in parents):
            raise StoreError(f"not a directory of the store: {'/'.join(parents)!r}")
        with self._root_fd(write=True, create=create) as root_fd:
            assert root_fd is not None
            dir_mode, _ = artifact_modes()
            uid = os.geteuid()
            fd = os.dup(root_fd)
            try:
                where = self.root
                for seg in parents:
                    where = where / seg
                    made = False
                    if create:
                        try:
                            os.mkdir(seg, dir_mode, dir_fd=fd)
                            made = True
                        except FileExistsError:
                            pass
                    try:
                        child = os.open(seg, nofollow.DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        raise StoreError(f"{where} vanished") from None
                    except OSError:
                        raise StoreRefused(
                            f"{where} is a link or not a directory: refused (nothing in the store is reached through a link)",
                            help=f"Remove {where}; dynprof makes it again.",
                        ) from None
                    os.close(fd)
                    fd = child
                    if made:
                        os.fchmod(fd, dir_mode)
                    problem = nofollow.dir_problem(os.fstat(fd), uid)
                    if problem is not None:
                        raise StoreRefused(
                            f"{where} is {problem}: refused",
                            help=f"Remove {where}, or point DYNPROF_ARTIFACT_DIR at a store of your own.",
                        )
                yield fd
            finally:
                os.close(fd)

    def private_dir(self, *parents: str) -> Path:
        """Make ``root/job/host/NAME`` (private, checked as the store's own directories are) and
        return its path: a place in the store for files that are not artifacts (the flight
        recorder's dumps). ``parents`` are the job, host and name segments."""
        if len(parents) != 3:
            raise StoreError(f"not a directory of the store: {'/'.join(parents)!r}")
        with self._store_dir(parents, create=True):
            pass
        return self.root.joinpath(*parents)

    # -- writing ---------------------------------------------------------------------------
    def create(
        self,
        kind: str,
        *,
        job: str | None = None,
        host: str | None = None,
        rank: int | None = None,
        pid: int | None = None,
        options: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ArtifactWriter:
        host = host or socket.gethostname()
        pid = os.getpid() if pid is None else pid
        now = time.time()
        stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        rank_seg = f"rank{rank}" if rank is not None else "node"
        parents = (safe_segment(job or "nojob"), safe_segment(host), rank_seg, safe_segment(kind))
        parent = self.root.joinpath(*parents)
        with contextlib.suppress(OSError, ArtifactError):
            self.sweep_stale()
        try:
            with self._kind_dir(parents, create=True) as kind_fd:
                name = f"{stamp}-{pid}"
                final = name
                n = 1
                while nofollow.lstat_at(kind_fd, final) is not None:
                    n += 1
                    final = f"{name}-{n}"
                # The writer's pid (and pid namespace) is in the name, so a directory left by a
                # writer that died can be swept; the marker inside says dynprof's writer made it.
                tmp = f".{final}.{owner_tag()}.tmp"
                os.mkdir(tmp, 0o700, dir_fd=kind_fd)
                try:
                    tmp_fd = os.open(tmp, nofollow.DIR_FLAGS, dir_fd=kind_fd)
                except OSError:
                    nofollow.rmtree_at(kind_fd, tmp)
                    raise
                try:
                    os.fchmod(tmp_fd, 0o700)
                    marker = json.dumps(
                        {"schema": "dynprof.temporary", "owner": owner_tag(), "created_at": utcnow_iso()}
                    )
                    nofollow.write_new_file(tmp_fd, TEMP_MARKER, marker.encode() + b"\n", 0o600)
                except OSError:
                    os.close(tmp_fd)
                    nofollow.rmtree_at(kind_fd, tmp)
                    raise
                else:
                    os.close(tmp_fd)
        except OSError as exc:
            raise StoreError(f"cannot create an artifact directory in {parent}: {exc.strerror}") from None
        manifest: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "kind": kind,
            "status": "writing",
            "job": job,
            "host": host,
            "rank": rank,
            "pid": pid,
            "created_at": utcnow_iso(),
            "finished_at": None,
            "options": options or {},
            "files": [],
            "summary": {},
            "error": None,
            "dynprof_version": __version__,
        }
        if extra:
            manifest.update(extra)
        return ArtifactWriter(
            store=self, path=parent / tmp, final_path=parent / final, manifest=manifest, parents=parents
        )

    # -- reading ---------------------------------------------------------------------------
    def _temporaries_at(self, root_fd: int) -> Iterator[tuple[TempDir, int]]:
        """Each temporary directory that dynprof's writer made (its marker inside, the store
        owner's, a directory at the artifact level, no link), with its kind directory's descriptor."""
        owner = os.fstat(root_fd).st_uid
        now = time.time()
        here = safe_segment(socket.gethostname())
        ns_here = str(pid_namespace())
        for parents, name, is_dir, is_link, kind_fd in nofollow.walk(root_fd, owner, _ARTIFACT_LEVEL):
            if not (is_dir and not is_link and _TEMP_NAME.fullmatch(name)):
                continue
            st = nofollow.lstat_at(kind_fd, name)
            if st is None or nofollow.dir_problem(st, owner) is not None:
                continue
            mark = nofollow.lstat_at(kind_fd, f"{name}/{TEMP_MARKER}")
            if mark is None or not stat.S_ISREG(mark.st_mode) or mark.st_uid != owner:
                continue
            path = self.root.joinpath(*parents, name)
            age = max(0.0, now - st.st_mtime)
            parts = name[1:].rsplit(".", 2)
            pid_text, _, ns = parts[1].partition("@") if len(parts) == 3 else ("", "", "")
            owner_pid = int(pid_text) if pid_text.isdigit() else None
            stale = age > STALE_TMP_AFTER_S
            # A dead owner is known only for a writer on this host, in this pid namespace.
            ours = parents[1] == here and ns == ns_here
            if not stale and owner_pid is not None and ours and age > DEAD_OWNER_GRACE_S:
                stale = not pid_alive(owner_pid)
            yield (
                TempDir(path, owner_pid, age, nofollow.disk_usage(path, exclude=(MANIFEST,)), stale, self.root),
                kind_fd,
            )

    def temporaries(self) -> builtins.list[TempDir]:
        """Temporary directories of artifacts being written, and stale ones left by dead writers."""
        with self._root_fd() as root_fd:
            if root_fd is None:
                return []
            return sorted((t for t, _ in self._temporaries_at(root_fd)), key=lambda t: t.path)

    def in_progress(self) -> builtins.list[Path]:
        return [t.path for t in self.temporaries()]

    def _sweep_at(self, root_fd: int) -> tuple[builtins.list[Path], builtins.list[TempDir]]:
        """Remove the stale temporaries (relative to their directory: never through a link);
        return what was removed and the live ones."""
        removed, live = [], []
        for t, kind_fd in self._temporaries_at(root_fd):
            if t.stale:
                nofollow.rmtree_at(kind_fd, t.path.name)
                removed.append(t.path)
            else:
                live.append(t)
        return removed, live

    def sweep_stale(self) -> builtins.list[Path]:
        """Remove the temporary directories of writers that died (or that are older than a bound).

        Only dynprof's own: in a store of ours, at the artifact level, with dynprof's marker inside."""
        if not os.path.lexists(self.root):
            return []
        with self._root_fd(write=True) as root_fd:
            assert root_fd is not None
            return self._sweep_at(root_fd)[0]

    def _scan_at(self, root_fd: int) -> tuple[builtins.list[Artifact], builtins.list[BadArtifact]]:
        owner = os.fstat(root_fd).st_uid
        found, bad = [], []
        for parents, name, is_dir, is_link, kind_fd in nofollow.walk(root_fd, owner, _ARTIFACT_LEVEL):
            if name.startswith("."):  # temporaries (in-progress) and other hidden entries
                continue
            path = self.root.joinpath(*parents, name)
            if is_link:
                bad.append(BadArtifact(path, "a symbolic link: not followed", self.root))
                continue
            st = nofollow.lstat_at(kind_fd, name) if is_dir else None
            if st is None:
                continue
            problem = nofollow.dir_problem(st, owner)
            if problem is not None:
                bad.append(BadArtifact(path, f"{problem}: refused", self.root))
                continue
            if nofollow.lstat_at(kind_fd, f"{name}/{MANIFEST}") is None:
                continue  # not an artifact (or it vanished)
            try:
                found.append(Artifact.load(path, root=self.root))
            except ArtifactError as exc:
                if nofollow.lstat_at(kind_fd, name) is not None:  # still there: damaged, not removed meanwhile
                    bad.append(BadArtifact(path, exc.message, self.root))
        return found, bad

    def scan(
        self, job: str | None = None, kind: str | None = None
    ) -> tuple[builtins.list[Artifact], builtins.list[BadArtifact]]:
        """The finished artifacts, newest first, and the directories whose manifest is bad."""
        with self._root_fd() as root_fd:
            if root_fd is None:
                return [], []
            arts, bad = self._scan_at(root_fd)
        found = [
            a for a in arts if (job is None or str(a.manifest.get("job")) == job) and (kind is None or a.kind == kind)
        ]
        # created_at counts milliseconds; the directory's name starts with the microsecond it was
        # made, so two artifacts of one millisecond still come newest first
        found.sort(key=lambda a: (a.created_at, a.path.name), reverse=True)
        return found, bad

    def list(self, job: str | None = None, kind: str | None = None) -> builtins.list[Artifact]:
        return self.scan(job=job, kind=kind)[0]

    def _relative(self, path: Path) -> tuple[str, ...] | None:
        """``path``'s segments under the root (by its path, or the root's resolved path), or None
        when it lies elsewhere."""
        full = os.path.abspath(path)
        for base in (os.path.abspath(self.root), os.path.realpath(self.root)):
            if full == base or full.startswith(base.rstrip("/") + "/"):
                return Path(full[len(base) :].lstrip("/")).parts
        return None

    def _load_inside(self, parts: tuple[str, ...], ref: str) -> Artifact | None:
        """The artifact at ``root/job/host/rank/kind/ID``, every step taken without following a
        link; None when there is none; a refusal when a step is a link or not the owner's."""
        if len(parts) == 6 and parts[-1] == MANIFEST:
            parts = parts[:-1]
        if len(parts) != 5 or any(p in ("", ".", "..") for p in parts):
            return None
        with self._root_fd() as root_fd:
            if root_fd is None:
                return None
            owner = os.fstat(root_fd).st_uid
            fd = os.dup(root_fd)
            try:
                for seg in parts:
                    st = nofollow.lstat_at(fd, seg)
                    if st is None:
                        return None
                    if stat.S_ISLNK(st.st_mode):
                        raise ArtifactError(
                            f"{ref[:200]!r} in {self.root} is reached through a symbolic link: refused",
                            help="Nothing in the store is read through a link; list artifacts with `dynprof ls`.",
                        )
                    child = nofollow.child_dir(fd, seg, owner)
                    if child is None:
                        problem = nofollow.dir_problem(st, owner) or "not usable"
                        raise ArtifactError(f"{ref[:200]!r} in {self.root}: {seg} is {problem}: refused")
                    os.close(fd)
                    fd = child
                if nofollow.lstat_at(fd, MANIFEST) is None:
                    return None
            finally:
                os.close(fd)
        return Artifact.load(self.root.joinpath(*parts), root=self.root)

    def get(self, ref: str, *, inside_only: bool = False) -> Artifact:
        """Find an artifact by path, by id (path under the root) or by a unique id suffix.

        Inside the store nothing is reached through a link. A path elsewhere is the directory
        given (``dynprof show DIR``). With ``inside_only`` (the sidecar), ``ref`` must be an id
        under the root: no absolute path, no ``..``."""
        if not isinstance(ref, str) or not ref or "\x00" in ref or len(ref) > 4096:
            raise ArtifactError(f"no artifact {str(ref)[:80]!r} in {self.root}")
        if inside_only:
            parts = Path(ref).parts
            if Path(ref).is_absolute() or ".." in parts:
                raise ArtifactError(f"no artifact {ref[:200]!r} in {self.root}")
        else:
            given = Path(ref).expanduser()
            try:
                p = given.parent if given.name == MANIFEST else given
                found = os.path.lexists(p / MANIFEST)
            except (OSError, ValueError):
                found = False
            if found:
                rel = self._relative(p)
                if rel is None:
                    return Artifact.load(p, root=None)  # a directory handed over, outside the store
                art = self._load_inside(rel, ref)
                if art is not None:
                    return art
                raise ArtifactError(f"{ref[:200]!r} is not an artifact of the store {self.root}")
        art = self._load_inside(Path(ref).parts, ref)
        if art is not None:
            return art
        suffix = ref.strip("/")
        matches = [a for a in self.list() if a.id == ref or a.id.endswith("/" + suffix)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ArtifactError(
                f"no artifact {ref[:200]!r} in {self.root}",
                help="List artifacts with `dynprof ls`; give a path or an id from its first column.",
            )
        raise ArtifactError(
            f"{ref[:200]!r} matches {len(matches)} artifacts",
            help="Give more of the id: " + ", ".join(a.id for a in matches[:5]),
        )

    def remove(self, path: Path) -> bool:
        """Delete the finished artifact at ``path``, an artifact directory of this store, under
        the store's lock; every directory on the way checked, never through a link. Whether it
        was deleted (False: not an artifact of this store, or already gone)."""
        parts = self._relative(path)
        if parts is None or len(parts) != 5 or not os.path.lexists(self.root):
            return False
        with self._root_fd(write=True) as root_fd:
            assert root_fd is not None
            with _store_lock(root_fd):
                try:
                    with self._kind_dir(parts[:4]) as kind_fd:
                        st = nofollow.lstat_at(kind_fd, parts[4])
                        if st is None or not stat.S_ISDIR(st.st_mode):
                            return False
                        nofollow.rmtree_at(kind_fd, parts[4])
                except (OSError, ArtifactError):
                    return False
        return True

    # -- size cap --------------------------------------------------------------------------
    def _placed_at(self, art: Artifact) -> int | None:
        """When ``art``'s directory was last changed in this store (its ``st_ctime_ns``: the
        rename that put it in place, for a finished artifact), read relative to its kind's
        directory, never through a link; None when it is gone. No process sets a change time:
        the ``created_at`` its manifest claims is the artifact's word, this is the store's."""
        parts = self._relative(art.path)
        if parts is None or len(parts) != 5:
            return None
        try:
            with self._kind_dir(parts[:4]) as kind_fd:
                st = nofollow.lstat_at(kind_fd, parts[4])
        except (OSError, ArtifactError):
            return None
        return None if st is None else st.st_ctime_ns

    def enforce_cap(self, keep: Path | None = None) -> builtins.list[Path]:
        """Delete the finished artifacts the store placed first until it fits under ``max_bytes``.

        Sizes are what is on disk: the blocks (``st_blocks``) of every file and directory of
        the store, manifests, the directories of the layout and live temporaries included, not
        what manifests claim; stale temporary directories are removed first. The order is the
        store's own (each artifact directory's change time), not a time an artifact claims.
        Deletions are relative to the artifact's directory, each directory on the way checked:
        never through a link."""
        if self.max_bytes <= 0 or not os.path.lexists(self.root):
            return []
        removed: builtins.list[Path] = []
        with self._root_fd(write=True) as root_fd:
            assert root_fd is not None
            with _store_lock(root_fd):
                removed += self._sweep_at(root_fd)[0]
                total = nofollow.disk_blocks(root_fd, ".")
                if total <= self.max_bytes:
                    return removed
                placed = []
                for art in self._scan_at(root_fd)[0]:
                    at = self._placed_at(art)
                    if at is not None and art.path != keep:
                        placed.append((at, str(art.path), art))
                for _, _, art in sorted(placed, key=lambda item: item[:2]):
                    if total <= self.max_bytes:
                        break
                    parts = self._relative(art.path)
                    if parts is None or len(parts) != 5:
                        continue
                    with contextlib.suppress(OSError, ArtifactError), self._kind_dir(parts[:4]) as kind_fd:
                        size = nofollow.disk_blocks(kind_fd, parts[4])
                        nofollow.rmtree_at(kind_fd, parts[4])
                        if nofollow.lstat_at(kind_fd, parts[4]) is None:
                            total -= size
                            removed.append(art.path)
        return removed


@contextlib.contextmanager
def _store_lock(root_fd: int) -> Iterator[None]:
    """The store's lock (its root's LOCK file, made when missing, never through a link), held
    exclusively for the ``with`` block."""
    # Read-only is enough for flock, so users of a store shared on purpose can all take it.
    fd = os.open(LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, artifact_modes()[1], dir_fd=root_fd)
    with os.fdopen(fd, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def open_temporary_dir(directory: Path | str) -> int | None:
    """A descriptor of ``directory`` if it is the temporary directory of an artifact being
    written in a dynprof store of ours (``ROOT/job/host/rank/kind/.NAME.tmp``, the root marked,
    every directory on the way ours and no link, dynprof's marker inside); None otherwise.

    Where an agent may write a file that a client names (``dynprof nccl`` has the agent write
    into the artifact it is writing)."""
    directory = Path(os.path.abspath(directory))
    if len(directory.parts) < 7 or not _TEMP_NAME.fullmatch(directory.name):
        return None
    root = directory.parents[4]
    if not os.path.lexists(root / STORE_MARKER):
        return None  # only a store that is already dynprof's: none is made or adopted here
    parents = directory.parts[-5:-1]
    uid = os.geteuid()
    try:
        with ArtifactStore(root)._kind_dir(tuple(parents)) as kind_fd:
            fd = nofollow.child_dir(kind_fd, directory.name, uid)
            if fd is None:
                return None
            mark = nofollow.lstat_at(fd, TEMP_MARKER)
            if mark is None or not stat.S_ISREG(mark.st_mode) or mark.st_uid != uid:
                os.close(fd)
                return None
            return fd
    except (OSError, ArtifactError):
        return None
