"""The artifact store itself (dynprof.store.store): lookup, listing and the size cap; the
sweep of stale temporaries; and that it only ever touches what it provably created.

Ownership: a store root is dynprof's when it holds the ``.dynprof-store`` marker (written when
dynprof creates the root or adopts an empty directory, or one laid out as an earlier dynprof's
store). A root owned by another user (or open to writes by others) is refused, links inside the
store are never followed, and the sweep of stale temporaries removes only dynprof's own. These
tests run as root here and play the other user with ``os.chown`` to an unused uid.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynprof.cli import main
from dynprof.errors import ArtifactError
from dynprof.sidecar.app import create_app
from dynprof.store import Artifact, ArtifactStore, safe_segment
from dynprof.store.owner import owner_tag, pid_namespace
from dynprof.store.writer import TEMP_MARKER
from tests.unit._store_cases import (
    HOUR_AGO,
    OTHER_UID,
    SECRET,
    STORE_MARKER,
    a_capture,
    host,
    mode,
    needs_root,
    old_tmp_dir,
    outside_artifact,
)


# -- lookup, listing, the size cap ------------------------------------------------------------
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


def on_disk(root: Path) -> int:
    """What ``root`` takes on disk, counted here independently of dynprof: the blocks of every
    file and directory (``du --apparent-size`` would miss them), each inode once, links not followed."""
    seen, total = set(), 0
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def a_kb_capture(store: ArtifactStore) -> Artifact:
    writer = store.create("trace", job="j")
    writer.write_bytes("f", b"x" * 1000)
    done = writer.finish()
    time.sleep(0.01)  # the next one is placed later, by the clock of the filesystem
    return done


def test_size_cap_evicts_oldest_first_and_keeps_the_new_one(tmp_path):
    # GIVEN a store holding two 1 KB artifacts, capped at what it takes on disk with a third
    # less a little: every file's and directory's blocks, manifests and layout included
    store = ArtifactStore(tmp_path / "store")
    first, second = a_kb_capture(store), a_kb_capture(store)
    two = on_disk(store.root)
    store.max_bytes = two + on_disk(second.path) - 1

    # WHEN a third is written
    third = a_kb_capture(store)

    # THEN only the oldest was evicted, and the store fits its cap on disk
    assert {a.path for a in store.list()} == {second.path, third.path}
    assert not first.path.exists()
    assert on_disk(store.root) <= store.max_bytes


def test_the_cap_counts_manifests_and_directories_of_many_small_artifacts(tmp_path):
    # GIVEN a store capped at 200 KiB
    store = ArtifactStore(tmp_path / "store", max_bytes=200 * 1024)

    # WHEN 120 small plans are written (a few hundred bytes of files each, several KiB on disk)
    for _ in range(120):
        writer = store.create("memory-plan", job="j")
        writer.write_bytes("plan.json", b"{}" * 100)
        writer.finish()

    # THEN the store takes at most its cap on disk, newest kept, and still holds artifacts
    assert on_disk(store.root) <= 200 * 1024
    assert 0 < len(store.list()) < 120


def test_the_cap_evicts_in_the_order_the_store_placed_artifacts_not_the_time_they_claim(tmp_path):
    # GIVEN a store with an artifact whose manifest, rewritten in place, claims to be from 2099,
    # and a later one
    store = ArtifactStore(tmp_path / "store")
    claims_new = a_kb_capture(store)
    manifest = json.loads((claims_new.path / "manifest.json").read_text())
    manifest["created_at"] = "2099-01-01T00:00:00.000000Z"
    with open(claims_new.path / "manifest.json", "r+") as fh:  # in place: no entry added or renamed
        fh.write(json.dumps(manifest))
        fh.truncate()
    assert Artifact.load(claims_new.path).created_at.startswith("2099")
    later = a_kb_capture(store)
    store.max_bytes = on_disk(store.root) + on_disk(later.path) - 1

    # WHEN a third pushes the store over its cap
    third = a_kb_capture(store)

    # THEN the artifact the store placed first went, whatever it claimed
    assert not claims_new.path.exists()
    assert later.path.exists() and third.path.exists()


def test_artifact_dir_env_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path / "x"))
    assert ArtifactStore().root == tmp_path / "x"
    assert os.environ["DYNPROF_ARTIFACT_DIR"].endswith("x")


def test_default_store_path_is_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNPROF_ARTIFACT_DIR")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    art = ArtifactStore().create("trace", job="j").finish()
    root = tmp_path / ".local" / "share" / "dynprof" / "artifacts"
    assert art.path.is_relative_to(root)
    for d in (tmp_path / ".local", tmp_path / ".local" / "share", root.parent, root):
        assert mode(d) == 0o700, d


# -- stale temporaries ------------------------------------------------------------------------
def test_stale_tmp_dirs_are_swept_counted_and_shown(tmp_path, capsys, dynprof_dirs):
    # GIVEN the temporary directory of a writer that died, and one of a writer still alive
    store = ArtifactStore()
    host = safe_segment(socket.gethostname())
    parent = store.root / "j" / host / "rank0" / "trace"
    parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = parent / f".20260101T000000.000000Z-{dead_pid}.{dead_pid}@{pid_namespace()}.tmp"
    stale.mkdir()
    (stale / "trace.json.gz").write_bytes(b"x" * 5000)
    old = time.time() - 60
    os.utime(stale, (old, old))
    live = parent / f".20260101T000001.000000Z-1.{owner_tag()}.tmp"
    other_ns = parent / f".20260101T000002.000000Z-1.{dead_pid}@1.tmp"  # another pid namespace: not judged
    other_ns.mkdir()
    os.utime(other_ns, (old, old))
    live.mkdir()
    (live / "trace.json.gz").write_bytes(b"y" * 3000)
    ancient = parent / ".20250101T000000.000000Z-1.tmp"  # no owner pid in the name, a day old
    ancient.mkdir()
    for d in (stale, live, other_ns, ancient):  # dynprof's writer leaves its marker in each
        (d / TEMP_MARKER).write_text("{}\n")
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
    real_load = Artifact.load

    def load_after_removal(path, root=None):
        if Path(path) == gone:
            import shutil

            shutil.rmtree(gone)
        return real_load(path, root)

    monkeypatch.setattr(Artifact, "load", staticmethod(load_after_removal))

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


@pytest.mark.parametrize(
    ("segment", "made"),
    [("job-1", "job-1"), ("a/b c", "a_b_c"), ("..", "_"), (".hidden.", "hidden"), ("", "_"), ("x" * 150, "x" * 100)],
)
def test_a_segment_is_made_one_plain_directory_name(segment, made):
    # A job, host or kind is one directory of the layout: never a path, never hidden, bounded.
    assert safe_segment(segment) == made
