"""The store only ever touches what it provably created.

A store root is dynprof's when it holds the ``.dynprof-store`` marker (written when dynprof
creates the root or adopts an empty directory, or one laid out as an earlier dynprof's store).
A root owned by another user (or open to writes by others) is refused, links inside the store
are never followed, and the sweep of stale temporaries removes only dynprof's own. These tests
run as root here and play the other user with ``os.chown`` to an unused uid.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import pytest

from dynprof import store as store_mod
from dynprof.cli import main
from dynprof.errors import ArtifactError
from dynprof.sidecar.app import create_app
from dynprof.store import MANIFEST, ArtifactStore

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
