"""The read side of the artifact store (dynprof.store.artifact): an artifact loaded through its
manifest, and its files verified against it."""

from __future__ import annotations

import pytest

from dynprof.errors import ArtifactError
from dynprof.store import Artifact, ArtifactStore


def test_verify_detects_a_modified_file(tmp_path):
    store = ArtifactStore(tmp_path)
    w = store.create("trace", job="j")
    w.write_text("f", "abc")
    art = w.finish()
    (art.path / "f").write_text("abd")
    assert art.verify() == ["f: sha256 mismatch"]


def test_load_rejects_a_directory_without_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="not a dynprof artifact"):
        Artifact.load(tmp_path)


def test_verify_says_missing_for_a_missing_file_only(tmp_path):
    # GIVEN an artifact in a store whose path holds the words "no such file", one file of it
    # deleted and another replaced by a directory
    store = ArtifactStore(tmp_path / "no such file")
    w = store.create("trace", job="j")
    w.write_text("a.txt", "abc")
    w.write_text("b.txt", "def")
    art = w.finish("complete")
    assert "no such file" in str(art.path)
    (art.path / "a.txt").unlink()
    (art.path / "a.txt").mkdir()
    (art.path / "b.txt").unlink()
    # WHEN it is verified
    problems = art.verify()
    # THEN the deleted file is missing, and the directory is refused for what it is
    assert problems == [f"a.txt: a.txt in {art.path} is not a regular file: refused", "b.txt: missing"]
