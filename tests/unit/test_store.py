"""The artifact store (dynprof.store): atomic publication, manifests, lookup and the size cap;
its hygiene; and that it only ever touches what it provably created.

Hygiene: private modes, no temporary directory left by a failed write, stale ones swept, and a
full disk reported as a StoreError after which the next capture works.

Ownership: a store root is dynprof's when it holds the ``.dynprof-store`` marker (written when
dynprof creates the root or adopts an empty directory, or one laid out as an earlier dynprof's
store). A root owned by another user (or open to writes by others) is refused, links inside the
store are never followed, and the sweep of stale temporaries removes only dynprof's own. These
tests run as root here and play the other user with ``os.chown`` to an unused uid.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
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
from dynprof.sidecar.app import create_app
from dynprof.store import MANIFEST, Artifact, ArtifactStore

STORE_MARKER = ".dynprof-store"  # the name is part of the store's format
OTHER_UID = 4242
SECRET = "dynprof-secret-" + hashlib.sha256(b"outside the store").hexdigest()[:16]
HOUR_AGO = time.time() - 2 * 3600

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (os.chown)")


def host() -> str:
    return store_mod._safe(socket.gethostname())


def old_tmp_dir(parent: Path, name: str = ".x.123@456.tmp") -> Path:
    """A directory shaped like a stale temporary, an hour and more old."""
    d = parent / name
    d.mkdir(parents=True)
    (d / "data").write_text("someone's data\n")
    os.utime(d, (HOUR_AGO, HOUR_AGO))
    return d


def a_capture(store: ArtifactStore, job: str = "j") -> Path:
    w = store.create("trace", job=job, rank=0)
    w.write_text("notes.txt", "hello")
    return w.finish().path


def outside_artifact(where: Path) -> Path:
    """A directory outside the store that looks like a finished artifact and holds a secret."""
    where.mkdir(parents=True, exist_ok=True)
    data = (SECRET + "\n").encode()
    (where / "secret.txt").write_bytes(data)
    manifest = {
        "schema": "dynprof.artifact",
        "schema_version": 1,
        "kind": "trace",
        "status": "complete",
        "created_at": "2026-01-01T00:00:00.000Z",
        "files": [{"name": "secret.txt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
    }
    (where / MANIFEST).write_text(json.dumps(manifest))
    return where


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp") if p.is_dir()]


# -- writing, reading, the size cap -------------------------------------------------------------
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


# -- hygiene: modes, failed writes, stale temporaries, a full disk -----------------------------
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


# -- the root: marked, ours, private -------------------------------------------------------------
def test_a_new_store_gets_a_marker_and_an_empty_directory_is_adopted(tmp_path):
    # GIVEN a store path that does not exist yet, and an empty directory
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir(mode=0o755)

    # WHEN a capture is written into each
    for root in (fresh, empty):
        a_capture(ArtifactStore(root))

    # THEN both roots carry dynprof's marker (a small JSON, private) and are private
    for root in (fresh, empty):
        marker = json.loads((root / STORE_MARKER).read_text())
        assert marker["schema"] == "dynprof.store" and marker["version"] == 1 and marker["created_at"]
        assert (root / STORE_MARKER).stat().st_mode & 0o777 == 0o600
        assert root.stat().st_mode & 0o777 == 0o700
        assert len(ArtifactStore(root).list()) == 1


def test_a_directory_that_is_not_a_store_is_refused_and_left_alone(tmp_path, capsys, monkeypatch):
    # GIVEN a directory of other data (a home directory, a shared directory) named as the store,
    # holding a directory shaped like a stale temporary, older than an hour
    home = tmp_path / "home"
    (home / "notes.txt").parent.mkdir()
    (home / "notes.txt").write_text("mine\n")
    theirs = old_tmp_dir(home / "a" / "b" / "c" / "d")
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(home))

    # WHEN a capture is written there, and the store listed
    with pytest.raises(ArtifactError) as refused:
        a_capture(ArtifactStore())
    code = main(["ls"])
    err = capsys.readouterr().err

    # THEN both are refused with a clear error naming the fix; nothing was created or deleted
    assert "not a dynprof store" in refused.value.message and "DYNPROF_ARTIFACT_DIR" in refused.value.help
    assert code == 1 and "not a dynprof store" in err and "Traceback" not in err
    assert theirs.is_dir() and (theirs / "data").read_text() == "someone's data\n"
    assert sorted(p.name for p in home.iterdir()) == ["a", "notes.txt"]


def test_a_simulated_root_filesystem_is_refused_and_its_tmp_dirs_survive(tmp_path, monkeypatch):
    # GIVEN a directory laid out like `/`: a proc-like tree with a cwd link back to the top,
    # and other programs' `*/*/*/*/.x.tmp` directories older than an hour
    fake_root = tmp_path / "slash"
    (fake_root / "proc" / "self").mkdir(parents=True)
    (fake_root / "proc" / "self" / "cwd").symlink_to(fake_root)
    victims = [
        old_tmp_dir(fake_root / "var" / "lib" / "app" / "cache", ".build.tmp"),
        old_tmp_dir(fake_root / "home" / "u" / "work" / "run", ".x.1@2.tmp"),
    ]
    (fake_root / "etc").mkdir()
    (fake_root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(fake_root))

    # WHEN a capture is asked to write there
    with pytest.raises(ArtifactError, match="not a dynprof store"):
        a_capture(ArtifactStore())

    # THEN no directory of theirs was deleted, and no marker was written
    assert all(v.is_dir() and (v / "data").exists() for v in victims)
    assert not (fake_root / STORE_MARKER).exists()


def test_ls_on_the_real_root_directory_is_a_clean_refusal(capsys, monkeypatch):
    # GIVEN the store pointed at `/` (an operator's mistake)
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", "/")

    # WHEN it is listed, as text and as JSON
    codes = [main(["ls"]), main(["ls", "--all", "--json"])]
    out, err = capsys.readouterr()

    # THEN it is refused cleanly (no walk of /proc, no traceback)
    assert codes == [1, 1]
    assert err.count("/ is not a dynprof store") == 2 and "Traceback" not in err
    assert json.loads(out)["error"]["type"] == "StoreRefused"


@needs_root
def test_a_store_root_owned_by_another_user_is_refused_for_writing(tmp_path):
    # GIVEN a store that another user owns, in which that user planted a link to a
    # directory of root's
    store = ArtifactStore(tmp_path / "theirs")
    a_capture(store)
    elsewhere = tmp_path / "roots-own"
    elsewhere.mkdir()
    (store.root / "victim").symlink_to(elsewhere)
    os.chown(store.root, OTHER_UID, OTHER_UID)

    # WHEN root's capture is written there (through the planted link, say)
    with pytest.raises(ArtifactError) as refused:
        a_capture(store, job="victim")

    # THEN it is refused, naming the owner; nothing was written through the link
    assert f"uid {OTHER_UID}" in refused.value.message
    assert list(elsewhere.iterdir()) == []


@needs_root
def test_a_directory_of_another_user_inside_the_store_is_refused(tmp_path):
    # GIVEN root's store, with a job directory that another user owns (who could rename
    # root's entries in it, or replace its host directory by a link)
    store = ArtifactStore(tmp_path / "store")
    a_capture(store)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job_dir = store.root / "shared"
    job_dir.mkdir()
    (job_dir / host()).symlink_to(elsewhere)
    os.chown(job_dir, OTHER_UID, OTHER_UID)

    # WHEN root's capture of that job is written
    with pytest.raises(ArtifactError, match=f"uid {OTHER_UID}"):
        a_capture(store, job="shared")

    # THEN nothing went into the other directory
    assert list(elsewhere.iterdir()) == []


def test_a_group_writable_store_root_is_refused(tmp_path):
    # GIVEN a store of ours that somebody opened to writes by others
    store = ArtifactStore(tmp_path / "store")
    a_capture(store)
    os.chmod(store.root, 0o777)

    # WHEN a capture is written and the store listed THEN both are refused
    with pytest.raises(ArtifactError, match="writable by others"):
        a_capture(store)
    with pytest.raises(ArtifactError, match="writable by others"):
        store.scan()


def test_the_artifact_mode_may_not_open_the_store_to_writes(monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_MODE", "0777")
    with pytest.raises(ArtifactError, match="write"):
        store_mod.artifact_modes()


# -- links inside the store ----------------------------------------------------------------------
def test_the_stale_sweep_never_deletes_through_a_link(tmp_path):
    # GIVEN a store whose kind directory was replaced by a link to a directory outside it,
    # holding a directory shaped like a stale temporary
    store = ArtifactStore(tmp_path / "store")
    a_capture(store)
    outside = tmp_path / "outside"
    victim = old_tmp_dir(outside, ".20260101T000000.000000Z-1.1@1.tmp")
    (store.root / "j" / host() / "rank0" / "stacks").symlink_to(outside)

    # WHEN captures are written (each sweeps stale temporaries and enforces the cap)
    store.max_bytes = 1
    a_capture(store)

    # THEN the directory outside is still there
    assert victim.is_dir() and (victim / "data").exists()


def test_the_sweep_removes_only_dynprofs_own_temporaries(tmp_path):
    # GIVEN a store with an abandoned temporary of dynprof's (its marker inside) and a
    # directory of the same shape that dynprof did not create
    store = ArtifactStore(tmp_path / "store")
    a_capture(store)
    parent = store.root / "j" / host() / "rank0" / "trace"
    ours = store.create("trace", job="j", rank=0)
    ours_path = ours.path
    os.utime(ours_path, (HOUR_AGO, HOUR_AGO))
    ours.aborted = "its process died"  # as if: nobody left to remove it
    not_ours = old_tmp_dir(parent, ".20260101T000000.000000Z-1.1@1.tmp")

    # WHEN the next capture sweeps
    removed = store.sweep_stale()

    # THEN only dynprof's own is removed
    assert removed == [ours_path] and not ours_path.exists()
    assert not_ours.is_dir()


def test_show_and_the_sidecar_refuse_an_entry_that_links_outside(tmp_path, capsys):
    # GIVEN a store with a good artifact and an entry that is a link to a directory outside
    # that looks like an artifact
    store = ArtifactStore()
    good = a_capture(store)
    evil = store.root / "j" / host() / "rank0" / "trace" / "20260101T000000.000000Z-1"
    evil.symlink_to(outside_artifact(tmp_path / "outside"))
    evil_id = str(evil.relative_to(store.root))

    # WHEN it is shown by id and by path, listed, and asked of the sidecar
    codes = [main(["show", evil_id]), main(["show", str(evil)])]
    out, err = capsys.readouterr()
    arts, bad = store.scan()
    client = create_app(store).test_client()
    api = client.get("/api/v1/artifacts").get_json()
    one = client.get(f"/api/v1/artifacts/{evil_id}")

    # THEN none of them reads what is outside
    assert codes == [1, 1] and "symbolic link" in err and SECRET not in out + err
    assert [a.path for a in arts] == [good] and [b.id for b in bad] == [evil_id]
    assert [a["id"] for a in api["artifacts"]] == [str(good.relative_to(store.root))]
    assert one.status_code == 404 and SECRET not in one.get_data(as_text=True)


def test_the_listing_does_not_walk_through_links(tmp_path):
    # GIVEN a store holding a proc-like link back into itself (as /proc/self/cwd is, on `/`)
    store = ArtifactStore()
    good = a_capture(store)
    (store.root / "proc" / "self").mkdir(parents=True)
    (store.root / "proc" / "self" / "cwd").symlink_to(store.root / "j" / host() / "rank0")

    # WHEN the sidecar and ls list it
    api = create_app(store).test_client().get("/api/v1/artifacts").get_json()
    arts, bad = store.scan()

    # THEN only the real artifact is listed, once
    assert [a["id"] for a in api["artifacts"]] == [str(good.relative_to(store.root))]
    assert [a.path for a in arts] == [good] and bad == []


def test_entries_vanishing_during_a_listing_are_skipped(tmp_path, monkeypatch):
    # GIVEN a store whose artifact disappears between the directory walk and its reading
    store = ArtifactStore()
    gone = a_capture(store)
    kept = a_capture(store, job="k")
    real_load = store_mod.Artifact.load

    def load_after_removal(path, root=None):
        if Path(path) == gone:
            import shutil

            shutil.rmtree(gone)
        return real_load(path, root)

    monkeypatch.setattr(store_mod.Artifact, "load", staticmethod(load_after_removal))

    # WHEN it is listed THEN the vanished one is skipped, the other listed, nothing raises
    arts, _ = store.scan()
    assert [a.path for a in arts] == [kept]


# -- stores written by earlier dynprof versions ----------------------------------------------------
def test_a_store_laid_out_by_an_earlier_dynprof_is_adopted(tmp_path):
    # GIVEN a store written before the marker existed: the job/host/rank/kind/ID layout
    store = ArtifactStore(tmp_path / "old")
    first = a_capture(store)
    (store.root / STORE_MARKER).unlink()
    (store.root / "j" / host() / ".flight-recorder").mkdir()

    # WHEN it is listed and written to
    listed = [a.path for a in store.list()]
    second = a_capture(store)

    # THEN it is used as a store and marked as one
    assert listed == [first]
    assert (store.root / STORE_MARKER).is_file() and {a.path for a in store.list()} == {first, second}


def test_the_sidecar_says_why_it_lists_nothing_from_a_directory_that_is_not_a_store(tmp_path):
    # GIVEN a sidecar whose store path names a directory of other data
    other = tmp_path / "other"
    (other / "proc" / "self").mkdir(parents=True)
    (other / "proc" / "self" / "cwd").symlink_to(other)
    client = create_app(ArtifactStore(other)).test_client()

    # WHEN its listing and its page are asked for
    api = client.get("/api/v1/artifacts")
    page = client.get("/")

    # THEN the API answers with the reason (no 500, nothing listed), and the page still shows
    assert api.status_code == 503 and "not a dynprof store" in api.get_json()["error"]
    assert page.status_code == 200 and "not a dynprof store" in page.get_data(as_text=True)


def test_the_flight_recorders_directory_is_made_through_the_store(tmp_path):
    # GIVEN a new store path, and a directory of other data
    new, other = ArtifactStore(tmp_path / "new"), ArtifactStore(tmp_path / "other")
    other.root.mkdir()
    (other.root / "data.txt").write_text("x\n")

    # WHEN the flight recorder's dump directory is asked of each
    made = new.private_dir("j", host(), ".flight-recorder")

    # THEN the new store is marked and the directory private; the other is refused
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700 and (new.root / STORE_MARKER).is_file()
    with pytest.raises(ArtifactError, match="not a dynprof store"):
        other.private_dir("j", host(), ".flight-recorder")
    assert sorted(p.name for p in other.root.iterdir()) == ["data.txt"]
