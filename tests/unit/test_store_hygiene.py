"""Store hygiene: private modes, no temporary directory left by a failed write, stale ones swept,
and a full disk reported as a StoreError after which the next capture works."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dynprof import store as store_mod
from dynprof.cli import main
from dynprof.errors import ArtifactError, StoreError
from dynprof.store import ArtifactStore


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp") if p.is_dir()]


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


def test_default_store_path_is_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNPROF_ARTIFACT_DIR")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    art = ArtifactStore().create("trace", job="j").finish()
    root = tmp_path / ".local" / "share" / "dynprof" / "artifacts"
    assert art.path.is_relative_to(root)
    for d in (tmp_path / ".local", tmp_path / ".local" / "share", root.parent, root):
        assert mode(d) == 0o700, d


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

    monkeypatch.setattr(store_mod.os, name, failing)
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


def test_stale_tmp_dirs_are_swept_counted_and_shown(tmp_path, capsys, dynprof_dirs):
    # GIVEN the temporary directory of a writer that died, and one of a writer still alive
    store = ArtifactStore()
    host = store_mod._safe(store_mod.socket.gethostname())
    parent = store.root / "j" / host / "rank0" / "trace"
    parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = parent / f".20260101T000000.000000Z-{dead_pid}.{dead_pid}@{store_mod._pid_namespace()}.tmp"
    stale.mkdir()
    (stale / "trace.json.gz").write_bytes(b"x" * 5000)
    old = time.time() - 60
    os.utime(stale, (old, old))
    live = parent / f".20260101T000001.000000Z-1.{store_mod.owner_tag()}.tmp"
    other_ns = parent / f".20260101T000002.000000Z-1.{dead_pid}@1.tmp"  # another pid namespace: not judged
    other_ns.mkdir()
    os.utime(other_ns, (old, old))
    live.mkdir()
    (live / "trace.json.gz").write_bytes(b"y" * 3000)
    ancient = parent / ".20250101T000000.000000Z-1.tmp"  # no owner pid in the name, a day old
    ancient.mkdir()
    for d in (stale, live, other_ns, ancient):  # dynprof's writer leaves its marker in each
        (d / store_mod.TEMP_MARKER).write_text("{}\n")
    for d in (stale, other_ns):
        os.utime(d, (old, old))
    os.utime(ancient, (time.time() - 86400, time.time() - 86400))
    foreign = parent / ".20250101T000000.000000Z-2.tmp"  # the same shape, but not dynprof's
    foreign.mkdir()
    os.utime(foreign, (time.time() - 86400, time.time() - 86400))

    # THEN ls --all tells them apart
    assert main(["ls", "--all", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["writing"] == [str(live), str(other_ns)] and sorted(listing["stale"]) == sorted(
        [str(stale), str(ancient)]
    )
    assert main(["ls", "--all"]) == 0
    out = capsys.readouterr().out
    assert "stale" in out and "writing" in out and "4.9 KiB" in out

    # WHEN the next capture is written under a cap that the live tmp dir counts against
    store.max_bytes = 3000 + 2500
    a = store.create("trace", job="j", rank=0)
    a.write_bytes("f", b"a" * 2000)
    first = a.finish()
    b = store.create("trace", job="j", rank=0)
    b.write_bytes("f", b"b" * 2000)
    b.finish()

    # THEN the stale ones are gone, the live one kept, and the cap evicted the older artifact
    assert not stale.exists() and not ancient.exists() and live.exists() and other_ns.exists()
    assert foreign.is_dir()  # only what dynprof provably made is ever removed
    assert not first.path.exists() and len(store.list()) == 1
    shutil.rmtree(live)
    shutil.rmtree(other_ns)


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
