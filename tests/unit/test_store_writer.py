"""The write side of the artifact store (dynprof.store.writer): an artifact hidden until it is
published whole, and the writer's hygiene: private modes (or DYNPROF_ARTIFACT_MODE's), no
temporary directory left by a failed write, and a full disk reported as a StoreError after which
the next capture works."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from dynprof.errors import ArtifactError, StoreError
from dynprof.store import ArtifactStore, artifact_modes
from tests.unit._store_cases import (
    mode,
    tmp_dirs,
)


# -- writing and publishing -------------------------------------------------------------------
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


# -- hygiene: modes, failed writes, a full disk -----------------------------------------------
def test_artifacts_are_private_by_default_whatever_the_umask(tmp_path, monkeypatch):
    # GIVEN a permissive umask and no DYNPROF_ARTIFACT_MODE
    monkeypatch.delenv("DYNPROF_ARTIFACT_MODE", raising=False)
    old = os.umask(0)
    try:
        store = ArtifactStore(tmp_path / "new" / "store")
        w = store.create("stacks", job="j", host="h", rank=0)
        # THEN the directory being written is private
        assert mode(w.path) == 0o700
        w.write_text("locals.txt", "password=hunter2")
        with open(w.file_path("raw.bin"), "wb") as fh:  # a file the caller writes itself
            fh.write(b"x")
        art = w.finish()
    finally:
        os.umask(old)
    # THEN the store, every level under it, the artifact and its files are 0700 / 0600
    for d in (store.root, store.root.parent, *art.path.relative_to(store.root).parents):
        assert mode(store.root / d if not d.is_absolute() else d) == 0o700, d
    assert mode(art.path) == 0o700
    assert {p.name: mode(p) for p in art.path.iterdir()} == {
        "locals.txt": 0o600,
        "raw.bin": 0o600,
        "manifest.json": 0o600,
    }


def test_artifact_mode_shares_a_store_on_purpose(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_MODE", "0750")
    store = ArtifactStore(tmp_path / "shared")
    w = store.create("trace", job="j")
    w.write_text("a.txt", "a")
    art = w.finish()
    assert mode(store.root) == 0o750 and mode(art.path) == 0o750 and mode(art.path / "a.txt") == 0o640
    monkeypatch.setenv("DYNPROF_ARTIFACT_MODE", "rwx")
    with pytest.raises(ArtifactError, match="not an octal mode"):
        store.create("trace", job="j")


def test_an_exception_while_writing_leaves_no_tmp_dir_when_the_writer_is_dropped(tmp_path):
    store = ArtifactStore(tmp_path)

    def capture() -> None:
        w = store.create("stacks", job="j")
        w.write_text("a.txt", "a")
        raise RuntimeError("the capture failed and nobody called finish")

    with pytest.raises(RuntimeError):
        capture()
    import gc

    gc.collect()
    assert tmp_dirs(tmp_path) == []


def inject_enospc(monkeypatch: pytest.MonkeyPatch, name: str, count: int = 1) -> list[int]:
    """Make the store's os.NAME raise ENOSPC ``count`` times (``open``: of a file it creates)."""
    real = getattr(os, name)
    calls = [0]

    def failing(*args: object, **kwargs: object) -> object:
        if name == "open" and not int(args[1]) & os.O_CREAT:  # type: ignore[call-overload]
            return real(*args, **kwargs)  # opening what exists (a directory) takes no space
        calls[0] += 1
        if calls[0] <= count:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)
    return calls


@pytest.mark.parametrize("where", ["replace", "rename", "open", "mkdir"])
def test_injected_enospc_is_a_store_error_with_no_tmp_dir_and_the_next_capture_works(tmp_path, monkeypatch, where):
    # GIVEN a store where one system call fails with "no space left on device"
    store = ArtifactStore(tmp_path)
    ArtifactStore(tmp_path).create("trace", job="j").finish()  # the store exists
    inject_enospc(monkeypatch, where, count=1)

    # WHEN a capture is written
    with pytest.raises(StoreError, match="No space left on device") as info:
        w = store.create("trace", job="j")
        w.write_text("trace.json", "{}")
        w.finish("complete")

    # THEN the error says what to do, no temporary directory is left, nothing half-written is listed
    assert "Free space" in info.value.help
    assert tmp_dirs(tmp_path) == []
    assert all(a.status == "complete" for a in store.list()) and len(store.list()) == 1

    # AND once space is back the next capture works
    monkeypatch.undo()
    w = store.create("trace", job="j")
    w.write_text("trace.json", "{}")
    assert w.finish("complete").status == "complete"
    assert len(store.list()) == 2 and tmp_dirs(tmp_path) == []


def test_a_failed_capture_records_the_reason_when_a_manifest_fits(tmp_path):
    # GIVEN a capture whose own write failed with ENOSPC (the disk has room for a manifest again)
    store = ArtifactStore(tmp_path)
    w = store.create("trace", job="j")
    path = w.file_path("trace.json.gz")
    path.write_bytes(b"partial")
    # WHEN the caller finishes it as failed
    art = w.finish("failed", error="OSError: [Errno 28] No space left on device")
    # THEN a failed artifact says why, and no temporary directory is left
    assert art.status == "failed" and "No space left" in art.manifest["error"]
    assert tmp_dirs(tmp_path) == []


def can_mount_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_a_full_tmpfs_is_a_store_error_with_no_tmp_dir_and_the_next_capture_works(tmp_path):
    mnt = Path("/tmp") / f"dynprof-enospc-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    if not can_mount_tmpfs(mnt):
        mnt.rmdir()
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN); the injected-ENOSPC tests cover it")
    try:
        # GIVEN a store on a 1 MiB filesystem
        store = ArtifactStore(mnt / "store")
        # WHEN a capture writes 2 MiB through the writer
        w = store.create("trace", job="j")
        with pytest.raises(StoreError, match="No space left on device"):
            w.write_bytes("trace.json.gz", b"x" * (2 << 20))
        failed = w.finish("failed", error="no space left")
        # AND a capture writes 2 MiB by itself (as torch's exporter does), then is finished failed
        w2 = store.create("trace", job="j")
        with pytest.raises(OSError), open(w2.file_path("trace.json.gz"), "wb") as fh:
            fh.write(b"x" * (2 << 20))
        failed2 = w2.finish("failed", error="OSError: No space left on device")
        # THEN no temporary directory is left, the failures say why, and the next capture works
        assert tmp_dirs(mnt) == []
        assert failed.status == failed2.status == "failed"
        ok = store.create("trace", job="j")
        ok.write_bytes("trace.json.gz", b"y" * 1000)
        assert ok.finish("complete").status == "complete"
        assert sorted(a.status for a in store.list()) == ["complete", "failed", "failed"]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        mnt.rmdir()


def test_the_artifact_mode_may_not_open_the_store_to_writes(monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_MODE", "0777")
    with pytest.raises(ArtifactError, match="write"):
        artifact_modes()
