"""The write side of the store: an artifact being written (:class:`ArtifactWriter`) in its
temporary directory (:class:`TempDir`), published whole by a rename once its manifest is
written; the modes of new artifacts (:func:`artifact_modes`); a file written whole
(:func:`write_file_atomically`).

The writer reaches the store's directories through the store that made it
(:meth:`dynprof.store.ArtifactStore.create`), never through a link.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dynprof import jsontext, nofollow, untrusted
from dynprof.errors import ArtifactError, StoreError
from dynprof.store.artifact import Artifact, InStore
from dynprof.store.manifest import MANIFEST, STATUSES, utcnow_iso
from dynprof.store.owner import owner_tag

DEFAULT_DIR_MODE = 0o700
TEMP_MARKER = ".dynprof-writing"
"""The file inside an artifact's temporary directory that says dynprof's writer made it."""


class WritableStore(Protocol):
    """What a writer needs of the store that made it (:class:`dynprof.store.ArtifactStore`)."""

    root: Path

    def _kind_dir(
        self, parents: tuple[str, ...], *, create: bool = False
    ) -> contextlib.AbstractContextManager[int]: ...

    def enforce_cap(self, keep: Path | None = None) -> builtins.list[Path]: ...


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
    if mode & 0o022:
        raise ArtifactError(
            f"DYNPROF_ARTIFACT_MODE={env!r} lets others write into the store",
            help="A store is shared for reading only: write it like 0750 or 0755.",
        )
    mode |= 0o700
    return mode, mode & 0o666


def write_file_atomically(directory: Path, name: str, data: bytes) -> Path:
    """Write ``directory/name`` whole, as the store writes a manifest: under a temporary name
    (new, never through a link, the store's file mode), then renamed over ``name``, so that a
    reader sees the old file or the new one, never half of one. ``directory`` itself is not
    reached through a link."""
    untrusted.check_name(name)
    _, file_mode = artifact_modes()
    tmp = f".{name}.{owner_tag()}.tmp"
    dir_fd = os.open(directory, nofollow.DIR_FLAGS)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        try:
            nofollow.write_new_file(dir_fd, tmp, data, file_mode)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
    return directory / name


@dataclass
class TempDir(InStore):
    """The temporary directory of an artifact being written (or left by a writer that died)."""

    path: Path
    owner_pid: int | None
    age_s: float
    size: int
    stale: bool
    root: Path | None = None

    @property
    def kind(self) -> str:
        return self.path.parent.name

    @property
    def rank(self) -> str:
        seg = self.path.parent.parent.name
        return seg[4:] if seg.startswith("rank") else "-"


@dataclass
class ArtifactWriter:
    """An artifact being written. Add files into :attr:`path`, then :meth:`finish`.

    If writing fails (no space left, ...) the writer raises :class:`StoreError` and leaves no
    temporary directory behind: :meth:`finish` with ``"failed"`` records the reason in a
    manifest when there is room for one, and otherwise removes everything."""

    store: WritableStore
    path: Path
    final_path: Path
    manifest: dict[str, Any]
    _files: builtins.list[str] = field(default_factory=list)
    finished: Artifact | None = None
    aborted: str | None = None
    parents: tuple[str, ...] = ()
    """``(job, host, rank, kind)`` segments of its directory under the store's root."""

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
        return self.write_text(name, jsontext.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")

    def abort(self, reason: str = "aborted") -> None:
        """Remove the temporary directory and everything in it."""
        if self.finished is None and self.aborted is None:
            self.aborted = reason
            with contextlib.suppress(OSError, ArtifactError), self.store._kind_dir(self.parents) as kind_fd:
                nofollow.rmtree_at(kind_fd, self.path.name)

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
        text = jsontext.dumps(self.manifest, indent=2, default=str) + "\n"
        with self.store._kind_dir(self.parents) as kind_fd:
            tmp_fd = os.open(self.path.name, nofollow.DIR_FLAGS, dir_fd=kind_fd)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(MANIFEST + ".tmp", dir_fd=tmp_fd)
                nofollow.write_new_file(tmp_fd, MANIFEST + ".tmp", text.encode(), file_mode)
                os.replace(MANIFEST + ".tmp", MANIFEST, src_dir_fd=tmp_fd, dst_dir_fd=tmp_fd)
                os.fchmod(tmp_fd, dir_mode)
            finally:
                os.close(tmp_fd)
            os.rename(self.path.name, self.final_path.name, src_dir_fd=kind_fd, dst_dir_fd=kind_fd)
            # Finished: its temporary marker goes (a sweep never looks at a finished artifact).
            with contextlib.suppress(OSError):
                os.unlink(f"{self.final_path.name}/{TEMP_MARKER}", dir_fd=kind_fd)

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
