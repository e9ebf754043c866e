"""An artifact's manifest: ``manifest.json``, the file that describes an artifact's directory.

Its schema (``dynprof.artifact``, version 1), the statuses a finished artifact may have, and
:func:`validate_manifest`, which checks a manifest read from disk field by field (a manifest is
untrusted input: docs/security.md). The bottom of :mod:`dynprof.store`: it imports no other
part of it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from dynprof import untrusted
from dynprof.errors import ArtifactError

MANIFEST = "manifest.json"
SCHEMA = "dynprof.artifact"
SCHEMA_VERSION = 1
STATUSES = ("complete", "partial", "failed")
MAX_MANIFEST_FILES = 10_000


def utcnow_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        untrusted.check_name(entry.get("name"))
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactError(f"file {entry['name']!r} has no valid size")
        if not isinstance(entry.get("sha256"), str):
            raise ArtifactError(f"file {entry['name']!r} has no sha256")
    return manifest
