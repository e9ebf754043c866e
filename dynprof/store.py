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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dynprof import __version__
from dynprof.errors import ArtifactError
from dynprof.paths import artifact_dir

MANIFEST = "manifest.json"
SCHEMA = "dynprof.artifact"
SCHEMA_VERSION = 1
STATUSES = ("complete", "partial", "failed")
DEFAULT_MAX_BYTES = 20 * 1024**3
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


@dataclass
class Artifact:
    """A finished artifact on disk, as described by its manifest."""

    path: Path
    manifest: dict[str, Any]
    root: Path | None = None

    @property
    def id(self) -> str:
        if self.root is not None:
            with contextlib.suppress(ValueError):
                return str(self.path.relative_to(self.root))
        return str(self.path)

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
    def size(self) -> int:
        return sum(int(f.get("size", 0)) for f in self.manifest.get("files", []))

    def file(self, name: str) -> Path:
        return self.path / name

    @classmethod
    def load(cls, path: Path, root: Path | None = None) -> Artifact:
        path = Path(path)
        if path.name == MANIFEST:
            path = path.parent
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise ArtifactError(
                f"{path} is not a dynprof artifact (no {MANIFEST})",
                help="List artifacts with `dynprof ls`.",
            ) from None
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"cannot read {manifest_path}: {exc}") from None
        if manifest.get("schema") != SCHEMA:
            raise ArtifactError(f"{manifest_path} is not a dynprof manifest")
        return cls(path=path, manifest=manifest, root=root)

    def verify(self) -> list[str]:
        """Check every listed file's size and sha256; return the problems found."""
        problems = []
        for entry in self.manifest.get("files", []):
            p = self.path / entry["name"]
            if not p.exists():
                problems.append(f"{entry['name']}: missing")
                continue
            if p.stat().st_size != entry["size"]:
                problems.append(f"{entry['name']}: size {p.stat().st_size} != {entry['size']}")
            elif sha256_file(p) != entry["sha256"]:
                problems.append(f"{entry['name']}: sha256 mismatch")
        return problems


@dataclass
class ArtifactWriter:
    """An artifact being written. Add files into :attr:`path`, then :meth:`finish`."""

    store: ArtifactStore
    path: Path
    final_path: Path
    manifest: dict[str, Any]
    _files: list[str] = field(default_factory=list)
    finished: Artifact | None = None

    def file_path(self, name: str) -> Path:
        """Path for a file the caller writes itself; it is listed in the manifest at finish."""
        if "/" in name or name in ("", ".", "..", MANIFEST):
            raise ArtifactError(f"invalid artifact file name {name!r}")
        if name not in self._files:
            self._files.append(name)
        return self.path / name

    def write_bytes(self, name: str, data: bytes) -> Path:
        p = self.file_path(name)
        p.write_bytes(data)
        return p

    def write_text(self, name: str, text: str) -> Path:
        p = self.file_path(name)
        p.write_text(text)
        return p

    def write_json(self, name: str, obj: Any) -> Path:
        return self.write_text(name, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")

    def finish(
        self,
        status: str = "complete",
        *,
        summary: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> Artifact:
        if self.finished is not None:
            return self.finished
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        files = []
        for name in self._files:
            p = self.path / name
            if p.exists():
                files.append({"name": name, "size": p.stat().st_size, "sha256": sha256_file(p)})
        self.manifest.update(
            status=status,
            finished_at=utcnow_iso(),
            files=files,
            summary=summary or self.manifest.get("summary") or {},
            error=error,
        )
        tmp_manifest = self.path / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(self.manifest, indent=2, default=str) + "\n")
        os.replace(tmp_manifest, self.path / MANIFEST)
        os.rename(self.path, self.final_path)
        artifact = Artifact(path=self.final_path, manifest=self.manifest, root=self.store.root)
        self.finished = artifact
        with contextlib.suppress(OSError):
            self.store.enforce_cap(keep=self.final_path)
        return artifact

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.finished is None:
            if exc is not None:
                self.finish("failed", error=f"{type(exc).__name__}: {exc}")
            else:
                self.finish("complete")


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
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArtifactError(
                f"cannot create artifact directory {parent}: {exc}",
                help="Set DYNPROF_ARTIFACT_DIR to a writable directory.",
            ) from None
        name = f"{stamp}-{pid}"
        final = parent / name
        n = 1
        while final.exists():
            n += 1
            final = parent / f"{name}-{n}"
        tmp = parent / f".{final.name}.tmp"
        tmp.mkdir(mode=0o755)
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
    def _manifests(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        # job/host/rank/kind/artifact/manifest.json; hidden (in-progress) dirs are skipped.
        for manifest in self.root.glob(f"*/*/*/*/*/{MANIFEST}"):
            if not manifest.parent.name.startswith("."):
                yield manifest

    def in_progress(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*/*/*/*/.*.tmp") if p.is_dir())

    def list(self, job: str | None = None, kind: str | None = None) -> list[Artifact]:
        found = []
        for manifest in self._manifests():
            try:
                art = Artifact.load(manifest.parent, root=self.root)
            except ArtifactError:
                continue
            if job is not None and str(art.manifest.get("job")) != job:
                continue
            if kind is not None and art.kind != kind:
                continue
            found.append(art)
        found.sort(key=lambda a: a.created_at, reverse=True)
        return found

    def get(self, ref: str) -> Artifact:
        """Find an artifact by path, by id (path under the root) or by a unique id suffix."""
        candidate = Path(ref).expanduser()
        for p in (candidate, self.root / ref):
            if (p / MANIFEST).exists() or (p.name == MANIFEST and p.exists()):
                root = self.root if self.root in p.resolve().parents else None
                return Artifact.load(p, root=self.root if root else None)
        matches = [a for a in self.list() if a.id == ref or a.id.endswith("/" + ref.strip("/"))]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ArtifactError(
                f"no artifact {ref!r} in {self.root}",
                help="List artifacts with `dynprof ls`; give a path or an id from its first column.",
            )
        raise ArtifactError(
            f"{ref!r} matches {len(matches)} artifacts",
            help="Give more of the id: " + ", ".join(a.id for a in matches[:5]),
        )

    # -- size cap --------------------------------------------------------------------------
    def enforce_cap(self, keep: Path | None = None) -> builtins.list[Path]:
        """Delete the oldest finished artifacts until the store fits under ``max_bytes``."""
        if self.max_bytes <= 0 or not self.root.is_dir():
            return []
        removed = []
        lock_path = self.root / ".lock"
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            arts = self.list()
            total = sum(a.size for a in arts)
            for art in sorted(arts, key=lambda a: a.created_at):
                if total <= self.max_bytes:
                    break
                if keep is not None and art.path == keep:
                    continue
                shutil.rmtree(art.path, ignore_errors=True)
                total -= art.size
                removed.append(art.path)
        return removed
