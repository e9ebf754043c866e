"""The artifact store: atomic publication, manifests, lookup and the size cap."""

from __future__ import annotations

import json
import os
import time

import pytest

from dynprof.errors import ArtifactError
from dynprof.store import Artifact, ArtifactStore
from dynprof.units import parse_size


def test_artifact_is_hidden_until_finished_then_complete_with_checksums(tmp_path):
    # GIVEN a store and an artifact being written
    store = ArtifactStore(tmp_path)
    writer = store.create("trace", job="j1", host="h", rank=3, pid=42, options={"steps": 5})
    writer.write_text("a.txt", "hello")

    # THEN while it is being written, ls does not show it as an artifact
    assert store.list() == []
    assert [p.name.startswith(".") for p in store.in_progress()] == [True]

    # WHEN it is finished
    art = writer.finish("complete", summary={"x": 1})

    # THEN it is listed, laid out by job/host/rank/kind, and its manifest describes the files
    (listed,) = store.list()
    assert listed.path == art.path
    assert art.path.relative_to(tmp_path).parts[:4] == ("j1", "h", "rank3", "trace")
    m = json.loads((art.path / "manifest.json").read_text())
    assert m["status"] == "complete" and m["kind"] == "trace" and m["rank"] == 3 and m["pid"] == 42
    assert m["schema_version"] == 1 and m["options"] == {"steps": 5} and m["summary"] == {"x": 1}
    assert m["files"] == [
        {"name": "a.txt", "size": 5, "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"}
    ]
    assert store.in_progress() == []
    assert art.verify() == []


def test_exception_inside_writer_marks_artifact_failed(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.create("memory", job="j") as w:
            w.write_text("partial.txt", "x")
            raise RuntimeError("boom")
    (art,) = store.list()
    assert art.status == "failed"
    assert "boom" in art.manifest["error"]


def test_verify_detects_a_modified_file(tmp_path):
    store = ArtifactStore(tmp_path)
    w = store.create("trace", job="j")
    w.write_text("f", "abc")
    art = w.finish()
    (art.path / "f").write_text("abd")
    assert art.verify() == ["f: sha256 mismatch"]


def test_get_by_path_id_and_unique_suffix(tmp_path):
    store = ArtifactStore(tmp_path)
    a = store.create("trace", job="j", rank=0).finish()
    time.sleep(0.002)
    b = store.create("stacks", job="j", rank=1).finish()
    assert store.get(str(a.path)).path == a.path
    assert store.get(a.id).path == a.path
    assert store.get(b.path.name).path == b.path
    with pytest.raises(ArtifactError, match="no artifact"):
        store.get("nope")


def test_list_filters_and_orders_newest_first(tmp_path):
    store = ArtifactStore(tmp_path)
    old = store.create("trace", job="a").finish()
    time.sleep(0.002)
    new = store.create("trace", job="b").finish()
    store.create("stacks", job="a").finish()
    assert [x.path for x in store.list(kind="trace")] == [new.path, old.path]
    assert {x.kind for x in store.list(job="a")} == {"trace", "stacks"}


def test_size_cap_evicts_oldest_first_and_keeps_the_new_one(tmp_path):
    # GIVEN a store capped at 2.5 KB, holding two 1 KB artifacts
    store = ArtifactStore(tmp_path, max_bytes=2500)
    first = store.create("trace", job="j")
    first.write_bytes("f", b"x" * 1000)
    first = first.finish()
    time.sleep(0.002)
    second = store.create("trace", job="j")
    second.write_bytes("f", b"x" * 1000)
    second = second.finish()
    time.sleep(0.002)

    # WHEN a third is written
    third = store.create("trace", job="j")
    third.write_bytes("f", b"x" * 1000)
    third = third.finish()

    # THEN only the oldest was evicted
    remaining = {a.path for a in store.list()}
    assert remaining == {second.path, third.path}
    assert not first.path.exists()


def test_load_rejects_a_directory_without_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="not a dynprof artifact"):
        Artifact.load(tmp_path)


@pytest.mark.parametrize(
    "text,value", [("1024", 1024), ("2K", 2048), ("1.5G", int(1.5 * 1024**3)), ("3MiB", 3 * 1024**2)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ArtifactError):
        parse_size("lots")


def test_artifact_dir_env_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path / "x"))
    assert ArtifactStore().root == tmp_path / "x"
    assert os.environ["DYNPROF_ARTIFACT_DIR"].endswith("x")


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
