"""The read side of the store: a finished artifact (:class:`Artifact`), read through its
validated manifest, and a directory whose manifest could not be used (:class:`BadArtifact`).

An artifact's files are read by plain name, never through a link, with size limits
(:mod:`dynprof.untrusted`).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dynprof import untrusted
from dynprof.errors import ArtifactError, MissingFile
from dynprof.store.manifest import MANIFEST, validate_manifest


def id_under(path: Path, root: Path | None) -> str:
    """An artifact's id: its path under the store's root (the full path outside it)."""
    if root is not None:
        with contextlib.suppress(ValueError):
            return str(path.relative_to(root))
    return str(path)


class InStore:
    """Something of the store named by its ``path``: its ``id``, that path under the store's
    ``root`` (the full path outside it)."""

    path: Path
    root: Path | None

    @property
    def id(self) -> str:
        return id_under(self.path, self.root)


@dataclass
class BadArtifact(InStore):
    """A directory in the store whose manifest could not be used, and why."""

    path: Path
    reason: str
    root: Path | None = None


@dataclass
class Artifact(InStore):
    """A finished artifact on disk, as described by its (validated) manifest."""

    path: Path
    manifest: dict[str, Any]
    root: Path | None = None

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
        return untrusted.open_in(self.path, name)

    def read_bytes(self, name: str, max_bytes: int = untrusted.JSON_MAX_BYTES) -> bytes:
        return untrusted.read_bytes_in(self.path, name, max_bytes)

    def read_text(self, name: str, max_bytes: int = untrusted.TEXT_MAX_BYTES) -> str:
        return untrusted.read_text_in(self.path, name, max_bytes)

    def read_json(self, name: str, max_bytes: int = untrusted.JSON_MAX_BYTES) -> Any:
        return untrusted.read_json_in(self.path, name, max_bytes)

    def has_file(self, name: str) -> bool:
        try:
            untrusted.stat_in(self.path, name)
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
        if root is not None and not untrusted.is_inside(root, path):
            raise ArtifactError(f"{path} resolves outside the store {root}: refused")
        data = untrusted.read_bytes_in(path, MANIFEST, untrusted.MANIFEST_MAX_BYTES)
        try:
            manifest = validate_manifest(untrusted.loads_json(data, str(manifest_path)))
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
            except MissingFile:
                problems.append(f"{name}: missing")
                continue
            except ArtifactError as exc:
                problems.append(f"{name}: {exc.message}")
                continue
            except OSError as exc:
                problems.append(f"{name}: {exc.strerror}")
                continue
            if digest.hexdigest() != entry["sha256"]:
                problems.append(f"{name}: sha256 mismatch")
        return problems
