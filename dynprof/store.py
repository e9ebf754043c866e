"""The artifact store: one self-describing directory per capture.

Layout under the store root (``DYNPROF_ARTIFACT_DIR``)::

    <job>/<host>/<rank>/<kind>/<UTC time>-<pid>/
        manifest.json      schema version, kind, job, host, rank, pid, times, options,
                           files (size, sha256), status, summary
        <files...>

An artifact is written under a hidden temporary name (``.<name>.tmp``) in the same directory
and renamed into place once its manifest is written, so a reader never sees a half-written
artifact as finished. The store keeps its total size under a cap by deleting the oldest
finished artifacts first.

Every file in a store is untrusted input (docs/security.md): manifests are read with size and
depth limits and checked field by field; a bad one is reported and skipped, never fatal to a
listing. Artifacts are private by default (directories 0700, files 0600);
``DYNPROF_ARTIFACT_MODE`` (e.g. ``0750``) shares a store on purpose. The temporary directory of
a capture that fails is removed by its writer, and ones left by a process that died are swept.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from dynprof import __version__, _safe_io
from dynprof.errors import ArtifactError, StoreError
from dynprof.paths import artifact_dir

MANIFEST = "manifest.json"
SCHEMA = "dynprof.artifact"
SCHEMA_VERSION = 1
STATUSES = ("complete", "partial", "failed")
DEFAULT_MAX_BYTES = 20 * 1024**3
DEFAULT_DIR_MODE = 0o700
STALE_TMP_AFTER_S = 3600.0
"""A temporary directory this old is stale even when its writer's pid still runs."""
DEAD_OWNER_GRACE_S = 5.0
MAX_MANIFEST_FILES = 10_000
_SAFE = re.compile(r"[^A-Za-z0-9_.@+-]")


def _safe(segment: str) -> str:
    segment = _SAFE.sub("_", segment).strip(".") or "_"
    return segment[:100]


def parse_size(text: str) -> int:
    """Parse ``"512M"``, ``"20G"``, ``"1073741824"`` into bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not match:
        raise ArtifactError(f"cannot read size {text!r}", help="Write it as bytes or with K, M, G, T.")
    number, unit = match.groups()
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}[unit.lower()]
    return int(float(number) * scale)


def utcnow_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def artifact_modes() -> tuple[int, int]:
    """(directory mode, file mode) of new artifacts: 0700/0600, or ``DYNPROF_ARTIFACT_MODE``.

    ``DYNPROF_ARTIFACT_MODE`` is an octal directory mode such as ``0750`` (group may read) or
    ``0755`` (everyone may read); files get the same bits without execute. The owner always
    keeps rwx."""
    env = os.environ.get("DYNPROF_ARTIFACT_MODE", "").strip()
    if not env:
        return DEFAULT_DIR_MODE, DEFAULT_DIR_MODE & 0o666
    try:
        mode = int(env.removeprefix("0o"), 8)
    except ValueError:
        raise ArtifactError(
            f"DYNPROF_ARTIFACT_MODE={env!r} is not an octal mode",
            help="Write it like 0700 (private, the default), 0750 (group may read) or 0755.",
        ) from None
    if not 0 <= mode <= 0o777:
        raise ArtifactError(f"DYNPROF_ARTIFACT_MODE={env!r} is out of range", help="Write it like 0700, 0750 or 0755.")
    mode |= 0o700
    return mode, mode & 0o666


def _make_dirs(path: Path, mode: int) -> None:
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


def _disk_usage(path: Path) -> int:
    """Bytes of the data files directly in ``path`` (artifacts are flat; the manifest aside),
    links not followed: what is on disk, not what a manifest claims."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                if entry.name != MANIFEST and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def _check_type(manifest: dict[str, Any], key: str, types: tuple[type, ...], required: bool = False) -> None:
    if key not in manifest:
        if required:
            raise ArtifactError(f"field {key!r} is missing")
        return
    value = manifest[key]
    if isinstance(value, bool) and bool not in types:
        raise ArtifactError(f"field {key!r} is a bool")
    if not isinstance(value, types):
        raise ArtifactError(f"field {key!r} is a {type(value).__name__}")


def validate_manifest(manifest: Any) -> dict[str, Any]:
    """Check a manifest read from disk field by field; :class:`ArtifactError` names what is wrong."""
    if not isinstance(manifest, dict):
        raise ArtifactError(f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("schema") != SCHEMA:
        raise ArtifactError("not a dynprof manifest (no schema dynprof.artifact)")
    _check_type(manifest, "kind", (str,), required=True)
    _check_type(manifest, "status", (str,), required=True)
    _check_type(manifest, "files", (list,), required=True)
    _check_type(manifest, "created_at", (str,), required=True)
    for key in ("job", "host", "finished_at", "error", "dynprof_version"):
        _check_type(manifest, key, (str, type(None)))
    for key in ("rank", "pid", "schema_version", "world_size", "local_rank"):
        _check_type(manifest, key, (int, type(None)))
    for key in ("options", "summary"):
        _check_type(manifest, key, (dict, type(None)))
    if len(manifest["kind"]) > 100 or len(manifest["status"]) > 100:
        raise ArtifactError("field 'kind' or 'status' is too long")
    files = manifest["files"]
    if len(files) > MAX_MANIFEST_FILES:
        raise ArtifactError(f"lists {len(files)} files, over {MAX_MANIFEST_FILES}")
    for entry in files:
        if not isinstance(entry, dict):
            raise ArtifactError("a 'files' entry is not an object")
        _safe_io.check_name(entry.get("name"))
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactError(f"file {entry['name']!r} has no valid size")
        if not isinstance(entry.get("sha256"), str):
            raise ArtifactError(f"file {entry['name']!r} has no sha256")
    return manifest


def _id_under(path: Path, root: Path | None) -> str:
    """An artifact's id: its path under the store's root (the full path outside it)."""
    if root is not None:
        with contextlib.suppress(ValueError):
            return str(path.relative_to(root))
    return str(path)


@dataclass
class BadArtifact:
    """A directory in the store whose manifest could not be used, and why."""

    path: Path
    reason: str
    root: Path | None = None

    @property
    def id(self) -> str:
        return _id_under(self.path, self.root)


@dataclass
class TempDir:
    """The temporary directory of an artifact being written (or left by a writer that died)."""

    path: Path
    owner_pid: int | None
    age_s: float
    size: int
    stale: bool
    root: Path | None = None

    @property
    def id(self) -> str:
        return _id_under(self.path, self.root)

    @property
    def kind(self) -> str:
        return self.path.parent.name

    @property
    def rank(self) -> str:
        seg = self.path.parent.parent.name
        return seg[4:] if seg.startswith("rank") else "-"


@dataclass
class Artifact:
    """A finished artifact on disk, as described by its (validated) manifest."""

    path: Path
    manifest: dict[str, Any]
    root: Path | None = None

    @property
    def id(self) -> str:
        return _id_under(self.path, self.root)

    @property
    def kind(self) -> str:
        return str(self.manifest.get("kind", "?"))

    @property
    def status(self) -> str:
        return str(self.manifest.get("status", "?"))

    @property
    def created_at(self) -> str:
        return str(self.manifest.get("created_at", ""))

    @property
    def files(self) -> builtins.list[dict[str, Any]]:
        files = self.manifest.get("files")
        return files if isinstance(files, builtins.list) else []

    @property
    def size(self) -> int:
        return sum(int(f.get("size", 0)) for f in self.files)

    def file(self, name: str) -> Path:
        return self.path / name

    # Readers of the artifact's files: a plain name, no link followed, with size limits.
    def open(self, name: str) -> IO[bytes]:
        return _safe_io.open_in(self.path, name)

    def read_bytes(self, name: str, max_bytes: int = _safe_io.JSON_MAX_BYTES) -> bytes:
        return _safe_io.read_bytes_in(self.path, name, max_bytes)

    def read_text(self, name: str, max_bytes: int = _safe_io.TEXT_MAX_BYTES) -> str:
        return _safe_io.read_text_in(self.path, name, max_bytes)

    def read_json(self, name: str, max_bytes: int = _safe_io.JSON_MAX_BYTES) -> Any:
        return _safe_io.read_json_in(self.path, name, max_bytes)

    def has_file(self, name: str) -> bool:
        try:
            _safe_io.stat_in(self.path, name)
        except ArtifactError:
            return False
        return True

    @classmethod
    def load(cls, path: Path, root: Path | None = None) -> Artifact:
        path = Path(path)
        if path.name == MANIFEST:
            path = path.parent
        manifest_path = path / MANIFEST
        try:
            if not os.path.lexists(manifest_path):
                raise ArtifactError(
                    f"{path} is not a dynprof artifact (no {MANIFEST})",
                    help="List artifacts with `dynprof ls`.",
                )
        except (OSError, ValueError) as exc:  # a name too long, a NUL byte
            raise ArtifactError(f"{str(path)[:200]} is not a dynprof artifact: {exc}") from None
        if root is not None and not _safe_io.is_inside(root, path):
            raise ArtifactError(f"{path} resolves outside the store {root}: refused")
        data = _safe_io.read_bytes_in(path, MANIFEST, _safe_io.MANIFEST_MAX_BYTES)
        try:
            manifest = validate_manifest(_safe_io.loads_json(data, str(manifest_path)))
        except ArtifactError as exc:
            raise ArtifactError(
                f"bad manifest {manifest_path}: {exc.message}", help="The artifact is damaged; remove it."
            ) from None
        return cls(path=path, manifest=manifest, root=root)

    def verify(self) -> builtins.list[str]:
        """Check every listed file's size and sha256; return the problems found.

        Only files inside the artifact's directory are looked at, never through a link."""
        problems = []
        for entry in self.files:
            name = entry["name"]
            try:
                with self.open(name) as fh:
                    size = os.fstat(fh.fileno()).st_size
                    if size != entry["size"]:
                        problems.append(f"{name}: size {size} != {entry['size']}")
                        continue
                    digest = hashlib.sha256()
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
            except ArtifactError as exc:
                problems.append(f"{name}: {exc.message}" if "no such file" not in exc.message else f"{name}: missing")
                continue
            except OSError as exc:
                problems.append(f"{name}: {exc.strerror}")
                continue
            if digest.hexdigest() != entry["sha256"]:
                problems.append(f"{name}: sha256 mismatch")
        return problems


@dataclass
class ArtifactWriter:
    """An artifact being written. Add files into :attr:`path`, then :meth:`finish`.

    If writing fails (no space left, ...) the writer raises :class:`StoreError` and leaves no
    temporary directory behind: :meth:`finish` with ``"failed"`` records the reason in a
    manifest when there is room for one, and otherwise removes everything."""

    store: ArtifactStore
    path: Path
    final_path: Path
    manifest: dict[str, Any]
    _files: builtins.list[str] = field(default_factory=list)
    finished: Artifact | None = None
    aborted: str | None = None

    def file_path(self, name: str) -> Path:
        """Path for a file the caller writes itself; it is listed in the manifest at finish."""
        if "/" in name or name in ("", ".", "..", MANIFEST):
            raise ArtifactError(f"invalid artifact file name {name!r}")
        if name not in self._files:
            self._files.append(name)
        return self.path / name

    def write_bytes(self, name: str, data: bytes) -> Path:
        p = self.file_path(name)
        try:
            p.write_bytes(data)
        except OSError as exc:
            with contextlib.suppress(OSError):
                p.unlink()  # give back what the partial file took
            raise StoreError(f"cannot write {name} of the artifact in {self.path.parent}: {exc.strerror}") from None
        return p

    def write_text(self, name: str, text: str) -> Path:
        return self.write_bytes(name, text.encode())

    def write_json(self, name: str, obj: Any) -> Path:
        return self.write_text(name, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")

    def abort(self, reason: str = "aborted") -> None:
        """Remove the temporary directory and everything in it."""
        if self.finished is None and self.aborted is None:
            self.aborted = reason
            shutil.rmtree(self.path, ignore_errors=True)

    def _publish(self, status: str, summary: dict[str, Any] | None, error: str | None) -> None:
        dir_mode, file_mode = artifact_modes()
        files = []
        for name in self._files:
            p = self.path / name
            if p.is_symlink() or not p.is_file():
                continue
            os.chmod(p, file_mode)
            files.append({"name": name, "size": p.stat().st_size, "sha256": sha256_file(p)})
        self.manifest.update(
            status=status,
            finished_at=utcnow_iso(),
            files=files,
            summary=summary or self.manifest.get("summary") or {},
            error=error,
        )
        tmp_manifest = self.path / (MANIFEST + ".tmp")
        fd = os.open(tmp_manifest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, file_mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(self.manifest, indent=2, default=str) + "\n")
        os.chmod(tmp_manifest, file_mode)
        os.replace(tmp_manifest, self.path / MANIFEST)
        os.chmod(self.path, dir_mode)
        os.rename(self.path, self.final_path)

    def finish(
        self,
        status: str = "complete",
        *,
        summary: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> Artifact:
        if self.finished is not None:
            return self.finished
        if self.aborted is not None:
            raise StoreError(f"the artifact in {self.path.parent} was not written: {self.aborted}")
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        try:
            self._publish(status, summary, error)
        except (OSError, ArtifactError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            if status == "failed" and os.path.isdir(self.path):
                # Room for a manifest that says why, without the (partial) files?
                for name in self._files:
                    with contextlib.suppress(OSError):
                        (self.path / name).unlink()
                self._files = []
                with contextlib.suppress(OSError, ArtifactError):
                    self._publish(status, summary, f"{error or 'failed'} (files removed: {reason})")
            if not os.path.isdir(self.final_path) or not os.path.lexists(self.final_path / MANIFEST):
                self.abort(reason)
                raise StoreError(f"cannot write the artifact in {self.path.parent}: {reason}") from None
        artifact = Artifact(path=self.final_path, manifest=self.manifest, root=self.store.root)
        self.finished = artifact
        with contextlib.suppress(OSError, ArtifactError):
            self.store.enforce_cap(keep=self.final_path)
        return artifact

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.finished is None and self.aborted is None:
            if exc is not None:
                self.finish("failed", error=f"{type(exc).__name__}: {exc}")
            else:
                self.finish("complete")

    def __del__(self) -> None:
        # A writer dropped unfinished (its capture raised and nobody called finish) takes its
        # temporary directory with it.
        with contextlib.suppress(Exception):
            if self.finished is None and self.aborted is None:
                self.abort("dropped unfinished")


class ArtifactStore:
    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root is not None else artifact_dir()
        if max_bytes is None:
            env = os.environ.get("DYNPROF_ARTIFACT_MAX_BYTES")
            max_bytes = parse_size(env) if env else DEFAULT_MAX_BYTES
        self.max_bytes = max_bytes

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
        parent = self.root / _safe(job or "nojob") / _safe(host) / rank_seg / _safe(kind)
        dir_mode, _ = artifact_modes()
        with contextlib.suppress(OSError, ArtifactError):
            self.sweep_stale()
        try:
            if not os.path.lexists(self.root):
                # The store itself (and, for the default path, ~/.local/share/dynprof) is private.
                _make_dirs(self.root, dir_mode)
            _make_dirs(parent, dir_mode)
            name = f"{stamp}-{pid}"
            final = parent / name
            n = 1
            while final.exists():
                n += 1
                final = parent / f"{name}-{n}"
            # The writer's pid (and pid namespace) is in the name, so a directory left by a
            # writer that died can be swept.
            tmp = parent / f".{final.name}.{owner_tag()}.tmp"
            os.mkdir(tmp, 0o700)
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
        return ArtifactWriter(store=self, path=tmp, final_path=final, manifest=manifest)

    # -- reading ---------------------------------------------------------------------------
    def _artifact_dirs(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        # job/host/rank/kind/artifact/; hidden (in-progress) dirs are skipped.
        for manifest in self.root.glob(f"*/*/*/*/*/{MANIFEST}"):
            if not manifest.parent.name.startswith("."):
                yield manifest.parent

    def temporaries(self) -> builtins.list[TempDir]:
        """Temporary directories of artifacts being written, and stale ones left by dead writers."""
        if not self.root.is_dir():
            return []
        found = []
        now = time.time()
        here = _safe(socket.gethostname())
        for p in sorted(self.root.glob("*/*/*/*/.*.tmp")):
            try:
                st = p.lstat()
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            age = max(0.0, now - st.st_mtime)
            parts = p.name[1:].rsplit(".", 2)
            pid_text, _, ns = parts[1].partition("@") if len(parts) == 3 else ("", "", "")
            owner = int(pid_text) if pid_text.isdigit() else None
            stale = age > STALE_TMP_AFTER_S
            # A dead owner is known only for a writer on this host, in this pid namespace.
            ours = p.parent.parent.parent.name == here and ns == str(_pid_namespace())
            if not stale and owner is not None and ours and age > DEAD_OWNER_GRACE_S:
                stale = not _pid_alive(owner)
            found.append(TempDir(p, owner, age, _disk_usage(p), stale, self.root))
        return found

    def in_progress(self) -> builtins.list[Path]:
        return [t.path for t in self.temporaries()]

    def sweep_stale(self) -> builtins.list[Path]:
        """Remove the temporary directories of writers that died (or that are older than a bound)."""
        removed = []
        for t in self.temporaries():
            if t.stale:
                shutil.rmtree(t.path, ignore_errors=True)
                removed.append(t.path)
        return removed

    def scan(
        self, job: str | None = None, kind: str | None = None
    ) -> tuple[builtins.list[Artifact], builtins.list[BadArtifact]]:
        """The finished artifacts, newest first, and the directories whose manifest is bad."""
        found = []
        bad = []
        for path in self._artifact_dirs():
            try:
                art = Artifact.load(path, root=self.root)
            except ArtifactError as exc:
                bad.append(BadArtifact(path, exc.message, self.root))
                continue
            if job is not None and str(art.manifest.get("job")) != job:
                continue
            if kind is not None and art.kind != kind:
                continue
            found.append(art)
        found.sort(key=lambda a: a.created_at, reverse=True)
        return found, bad

    def list(self, job: str | None = None, kind: str | None = None) -> builtins.list[Artifact]:
        return self.scan(job=job, kind=kind)[0]

    def get(self, ref: str, *, inside_only: bool = False) -> Artifact:
        """Find an artifact by path, by id (path under the root) or by a unique id suffix.

        With ``inside_only`` (the sidecar), ``ref`` must be an id under the root: no absolute
        path, no ``..``, nothing that resolves outside the store."""
        if not isinstance(ref, str) or not ref or "\x00" in ref or len(ref) > 4096:
            raise ArtifactError(f"no artifact {str(ref)[:80]!r} in {self.root}")
        candidates: builtins.list[Path] = []
        if inside_only:
            parts = Path(ref).parts
            if Path(ref).is_absolute() or ".." in parts:
                raise ArtifactError(f"no artifact {ref[:200]!r} in {self.root}")
            candidates = [self.root / ref]
        else:
            candidates = [Path(ref).expanduser(), self.root / ref]
        for p in candidates:
            try:
                if p.name == MANIFEST:
                    p = p.parent
                found = os.path.lexists(p / MANIFEST)
            except (OSError, ValueError):
                continue
            if found:
                inside = _safe_io.is_inside(self.root, p)
                if inside_only and not inside:
                    raise ArtifactError(f"no artifact {ref[:200]!r} in {self.root}")
                return Artifact.load(p, root=self.root if inside else None)
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

    # -- size cap --------------------------------------------------------------------------
    def enforce_cap(self, keep: Path | None = None) -> builtins.list[Path]:
        """Delete the oldest finished artifacts until the store fits under ``max_bytes``.

        Sizes are what is on disk (not what manifests claim); stale temporary directories are
        removed first and live ones count against the cap."""
        if self.max_bytes <= 0 or not self.root.is_dir():
            return []
        removed = []
        lock_path = self.root / ".lock"
        # Read-only is enough for flock, so users of a store shared on purpose can all take it.
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, artifact_modes()[1])
        with os.fdopen(fd, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            temps = self.temporaries()
            for t in temps:
                if t.stale:
                    shutil.rmtree(t.path, ignore_errors=True)
                    removed.append(t.path)
            total = sum(t.size for t in temps if not t.stale)
            arts = [(a, _disk_usage(a.path)) for a in self.list()]
            total += sum(size for _, size in arts)
            for art, size in sorted(arts, key=lambda item: item[0].created_at):
                if total <= self.max_bytes:
                    break
                if keep is not None and art.path == keep:
                    continue
                shutil.rmtree(art.path, ignore_errors=True)
                total -= size
                removed.append(art.path)
        return removed


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_tag() -> str:
    """``PID@PIDNS`` of this process: what a temporary directory's name records of its writer."""
    return f"{os.getpid()}@{_pid_namespace()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True
