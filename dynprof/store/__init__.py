"""The artifact store: one self-describing directory per capture.

Layout under the store root (``DYNPROF_ARTIFACT_DIR``)::

    <job>/<host>/<rank>/<kind>/<UTC time>-<pid>/
        manifest.json      schema version, kind, job, host, rank, pid, times, options,
                           files (size, sha256), status, summary
        <files...>

An artifact is written under a hidden temporary name (``.<name>.<pid>@<pidns>.tmp``, holding
dynprof's own ``.dynprof-writing`` marker) in the same directory and renamed into place once its
manifest is written, so a reader never sees a half-written artifact as finished. The store keeps
what it takes on disk under a cap (the blocks of every file and directory in it, manifests and
the layout's directories included) by deleting first the finished artifacts it placed first (by
each artifact directory's change time, which no artifact can claim, not its manifest's
``created_at``).

The store only ever deletes what it provably created. Its root holds a ``.dynprof-store``
marker, written when dynprof creates the root or adopts an empty directory (or one laid out as
an earlier dynprof's store, every entry ``job/host/rank/kind/ID``); any other non-empty
directory is refused. A root owned by another user, or open to writes by others, is refused
for writing (and, open to writes, for reading too); so is every directory below it that is not
the root owner's. Nothing inside the store is reached through a link: the walks open each
directory relative to its parent with ``O_NOFOLLOW``, and deletions and renames are relative
to directory descriptors (:mod:`dynprof.nofollow`).

Every file in a store is untrusted input (docs/security.md): manifests are read with size and
depth limits and checked field by field; a bad one is reported and skipped, never fatal to a
listing. Artifacts are private by default (directories 0700, files 0600);
``DYNPROF_ARTIFACT_MODE`` (e.g. ``0750``) shares a store on purpose. The temporary directory of
a capture that fails is removed by its writer, and ones left by a process that died are swept.

Its parts, each importing only those before it: :mod:`~dynprof.store.manifest` (the manifest's
schema and its check), :mod:`~dynprof.store.artifact` (the read side: a finished artifact),
:mod:`~dynprof.store.owner` (which process writes), :mod:`~dynprof.store.writer` (the write
side: an artifact being written, its temporary directory, the modes) and
:mod:`~dynprof.store.store` (the store: its root, layout, listing, lookup and pruning). Import
their names from here.
"""

from __future__ import annotations

from dynprof.store.artifact import Artifact, BadArtifact
from dynprof.store.manifest import (
    MANIFEST,
    MAX_MANIFEST_FILES,
    SCHEMA,
    SCHEMA_VERSION,
    STATUSES,
    utcnow_iso,
    validate_manifest,
)
from dynprof.store.owner import owner_tag
from dynprof.store.store import (
    DEAD_OWNER_GRACE_S,
    DEFAULT_MAX_BYTES,
    LOCK,
    MAX_LEGACY_ENTRIES,
    NOT_A_STORE_HELP,
    STALE_TMP_AFTER_S,
    STORE_FORMAT_VERSION,
    STORE_MARKER,
    STORE_SCHEMA,
    ArtifactStore,
    StoreRefused,
    open_temporary_dir,
    safe_segment,
)
from dynprof.store.writer import (
    DEFAULT_DIR_MODE,
    TEMP_MARKER,
    ArtifactWriter,
    TempDir,
    artifact_modes,
    sha256_file,
    write_file_atomically,
)

__all__ = [
    "DEAD_OWNER_GRACE_S",
    "DEFAULT_DIR_MODE",
    "DEFAULT_MAX_BYTES",
    "LOCK",
    "MANIFEST",
    "MAX_LEGACY_ENTRIES",
    "MAX_MANIFEST_FILES",
    "NOT_A_STORE_HELP",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STALE_TMP_AFTER_S",
    "STATUSES",
    "STORE_FORMAT_VERSION",
    "STORE_MARKER",
    "STORE_SCHEMA",
    "TEMP_MARKER",
    "Artifact",
    "ArtifactStore",
    "ArtifactWriter",
    "BadArtifact",
    "StoreRefused",
    "TempDir",
    "artifact_modes",
    "open_temporary_dir",
    "owner_tag",
    "safe_segment",
    "sha256_file",
    "utcnow_iso",
    "validate_manifest",
    "write_file_atomically",
]
