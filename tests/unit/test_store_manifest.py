"""An artifact's manifest (dynprof.store.manifest): a manifest read from disk is checked field
by field, and what is wrong is named."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dynprof.errors import ArtifactError
from dynprof.store.manifest import MAX_MANIFEST_FILES, SCHEMA, utcnow_iso, validate_manifest


def a_manifest(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": 1,
        "kind": "trace",
        "status": "complete",
        "job": "j",
        "rank": 0,
        "created_at": "2026-01-01T00:00:00.000Z",
        "options": {},
        "files": [{"name": "a.txt", "size": 5, "sha256": "0" * 64}],
    }
    doc.update(changes)
    return doc


def test_a_good_manifest_is_returned_as_it_is():
    doc = a_manifest(rank=None, summary=None, extra_field=[1, 2])
    assert validate_manifest(doc) is doc


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ([], "a JSON list, not an object"),
        (a_manifest(schema="other"), "not a dynprof manifest"),
        ({k: v for k, v in a_manifest().items() if k != "kind"}, "field 'kind' is missing"),
        (a_manifest(rank=True), "field 'rank' is a bool"),
        (a_manifest(job=3), "field 'job' is a int"),
        (a_manifest(options=[]), "field 'options' is a list"),
        (a_manifest(kind="k" * 101), "'kind' or 'status' is too long"),
        (a_manifest(files=["a.txt"]), "a 'files' entry is not an object"),
        (a_manifest(files=[{"name": "a", "size": -1, "sha256": "0"}]), "file 'a' has no valid size"),
        (a_manifest(files=[{"name": "a", "size": True, "sha256": "0"}]), "file 'a' has no valid size"),
        (a_manifest(files=[{"name": "a", "size": 1}]), "file 'a' has no sha256"),
    ],
)
def test_a_bad_manifest_is_refused_with_what_is_wrong(manifest, message):
    with pytest.raises(ArtifactError, match=re.escape(message)):
        validate_manifest(manifest)


@pytest.mark.parametrize("name", ["../secret", "a/b", "", None])
def test_a_file_name_that_is_not_a_plain_name_is_refused(name):
    with pytest.raises(ArtifactError):
        validate_manifest(a_manifest(files=[{"name": name, "size": 1, "sha256": "0"}]))


def test_a_manifest_listing_too_many_files_is_refused():
    files = [{"name": f"f{i}", "size": 0, "sha256": "0"} for i in range(MAX_MANIFEST_FILES + 1)]
    with pytest.raises(ArtifactError, match=f"over {MAX_MANIFEST_FILES}"):
        validate_manifest(a_manifest(files=files))


def test_times_are_utc_iso_with_milliseconds_and_a_z():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", utcnow_iso())
