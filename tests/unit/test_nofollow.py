"""Files and directories reached without following a link (dynprof.nofollow): walking, creating
and deleting relative to directory descriptors, and which directories belong to a tree."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprof import nofollow

OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (os.chown)")


@pytest.fixture
def dir_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, nofollow.DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_make_dirs_gives_each_missing_directory_exactly_the_mode_and_leaves_the_others(tmp_path):
    # GIVEN an existing directory with its own mode, and a permissive umask
    (tmp_path / "a").mkdir(mode=0o755)
    os.chmod(tmp_path / "a", 0o755)
    old = os.umask(0)
    try:
        # WHEN a path three levels below it is made
        nofollow.make_dirs(tmp_path / "a" / "b" / "c" / "d", 0o700)
    finally:
        os.umask(old)
    # THEN each new level has the mode, the existing one is untouched
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c", "a/b/c/d")] == [0o755, 0o700, 0o700, 0o700]
    nofollow.make_dirs(tmp_path / "a" / "b", 0o750)  # all there: nothing changes
    assert mode(tmp_path / "a" / "b") == 0o700


def test_disk_usage_counts_the_regular_files_directly_inside_and_follows_no_link(tmp_path):
    # GIVEN a directory with two files, an excluded one, a subdirectory and a link to a big file
    big = tmp_path / "big"
    big.write_bytes(b"x" * 10_000)
    d = tmp_path / "d"
    d.mkdir()
    (d / "a").write_bytes(b"x" * 100)
    (d / "b").write_bytes(b"x" * 20)
    (d / "manifest.json").write_bytes(b"x" * 5000)
    (d / "sub").mkdir()
    (d / "sub" / "c").write_bytes(b"x" * 7000)
    (d / "link").symlink_to(big)
    # THEN only the two files count
    assert nofollow.disk_usage(d, exclude=("manifest.json",)) == 120
    assert nofollow.disk_usage(d) == 5120
    assert nofollow.disk_usage(tmp_path / "missing") == 0


def test_dir_problem_names_what_keeps_a_directory_out_of_the_tree(tmp_path):
    (tmp_path / "file").write_text("x")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    uid = os.geteuid()
    assert nofollow.dir_problem(os.stat(tmp_path), uid) is None
    assert nofollow.dir_problem(os.stat(tmp_path / "file"), uid) == "not a directory"
    assert nofollow.dir_problem(os.stat(tmp_path), uid + 1) == (
        f"owned by uid {uid}, not by the store's owner (uid {uid + 1})"
    )
    assert nofollow.dir_problem(os.stat(shared), uid) == "writable by others (mode 0775)"


def test_child_dir_opens_only_the_owners_directories_never_a_link(tmp_path, dir_fd):
    # GIVEN a directory, a link to it, a file, a group-writable directory
    (tmp_path / "ok").mkdir(mode=0o700)
    (tmp_path / "ok" / "inside").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    (tmp_path / "file").write_text("x")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    uid = os.geteuid()

    # THEN only the plain directory of the owner is opened
    fd = nofollow.child_dir(dir_fd, "ok", uid)
    assert fd is not None
    try:
        assert os.listdir(fd) == ["inside"]
    finally:
        os.close(fd)
    for name in ("link", "file", "open", "missing"):
        assert nofollow.child_dir(dir_fd, name, uid) is None, name
    assert nofollow.child_dir(dir_fd, "ok", uid + 1) is None  # another owner's tree


def test_entries_are_sorted_and_say_directory_and_link_without_following(tmp_path, dir_fd):
    (tmp_path / "b").mkdir()
    (tmp_path / "a").write_text("x")
    (tmp_path / "c").symlink_to(tmp_path / "b")
    assert nofollow.entries(dir_fd) == [("a", False, False), ("b", True, False), ("c", False, True)]


def test_walk_yields_the_entries_of_one_level_entering_only_the_trees_directories(tmp_path, dir_fd):
    # GIVEN a tree two levels deep with a link, a hidden directory and an open directory above
    # the level, and a link at the level
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "z").mkdir()
    (tmp_path / "x" / "y" / "f").write_text("x")
    (tmp_path / "x" / "y" / "l").symlink_to(tmp_path)
    (tmp_path / "x" / ".hidden" / "h").mkdir(parents=True)
    (tmp_path / "x" / "open" / "o").mkdir(parents=True)
    os.chmod(tmp_path / "x" / "open", 0o777)
    (tmp_path / "x" / "through").symlink_to(tmp_path / "x" / "y")
    (tmp_path / "top.txt").write_text("x")

    # WHEN it is walked to the second level
    found = [
        (parents, name, is_dir, is_link) for parents, name, is_dir, is_link, _ in nofollow.walk(dir_fd, os.geteuid(), 2)
    ]

    # THEN what lies at that level is yielded, links included but never entered
    assert found == [(("x", "y"), "f", False, False), (("x", "y"), "l", False, True), (("x", "y"), "z", True, False)]


def test_walk_hands_out_the_descriptor_of_the_parent_directory_while_it_walks(tmp_path, dir_fd):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("hello")
    sizes = {}
    for parents, name, _, _, parent_fd in nofollow.walk(dir_fd, os.geteuid(), 1):
        st = nofollow.lstat_at(parent_fd, name)
        sizes[(parents, name)] = st.st_size if st is not None else None
    assert sizes == {(("x",), "f"): 5}


def test_rmtree_at_removes_a_tree_and_the_links_in_it_never_what_they_point_to(tmp_path, dir_fd):
    # GIVEN a tree holding links to a directory and a file outside it
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "secret").write_text("mine")
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "a" / "dirlink").symlink_to(outside)
    (tree / "filelink").symlink_to(outside / "secret")
    (tmp_path / "toplink").symlink_to(outside)

    # WHEN the tree is removed, and a name that is a link
    nofollow.rmtree_at(dir_fd, "tree")
    nofollow.rmtree_at(dir_fd, "toplink")
    nofollow.rmtree_at(dir_fd, "missing")

    # THEN the tree is gone, what its links pointed to is whole, and the link named is left
    assert not os.path.lexists(tree)
    assert (outside / "secret").read_text() == "mine" and (outside / "keep").is_dir()
    assert (tmp_path / "toplink").is_symlink()


def test_lstat_at_looks_at_a_link_itself(tmp_path, dir_fd):
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    st = nofollow.lstat_at(dir_fd, "l")
    assert st is not None and stat.S_ISLNK(st.st_mode)
    assert nofollow.lstat_at(dir_fd, "missing") is None


def test_write_new_file_creates_with_the_mode_and_never_through_a_link_or_over_a_file(tmp_path, dir_fd):
    # GIVEN a permissive umask, an existing file and a dangling link pointing outside
    (tmp_path / "there").write_text("old")
    target = tmp_path / "elsewhere"
    (tmp_path / "dangling").symlink_to(target)
    old = os.umask(0)
    try:
        # WHEN files are written
        nofollow.write_new_file(dir_fd, "new", b"data", 0o640)
        with pytest.raises(FileExistsError):
            nofollow.write_new_file(dir_fd, "there", b"data", 0o600)
        with pytest.raises(FileExistsError):
            nofollow.write_new_file(dir_fd, "dangling", b"data", 0o600)
    finally:
        os.umask(old)
    # THEN only the new name was written, with exactly its mode
    assert (tmp_path / "new").read_bytes() == b"data" and mode(tmp_path / "new") == 0o640
    assert (tmp_path / "there").read_text() == "old"
    assert not target.exists()


def test_unsafe_ancestor_is_none_under_directories_of_our_own(tmp_path):
    assert nofollow.unsafe_ancestor(tmp_path / "store") is None


@needs_root
def test_unsafe_ancestor_names_a_directory_of_another_user_above(tmp_path):
    # GIVEN a directory of another user above the path
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    # THEN it is named
    assert nofollow.unsafe_ancestor(theirs / "store") == f"{theirs} belongs to uid {OTHER_UID}"


def test_disk_blocks_counts_files_directories_and_links_once_never_following(tmp_path, dir_fd):
    # GIVEN a tree: a file, a subdirectory with a file, a hard link to the first file, and a
    # link to a large file outside the tree
    (tmp_path / "a").write_bytes(b"x" * 10_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 100)
    os.link(tmp_path / "a", tmp_path / "sub" / "a-again")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(b"z" * 1_000_000)
    os.symlink(outside, tmp_path / "link")

    # WHEN its disk use is counted
    try:
        total = nofollow.disk_blocks(dir_fd, ".")
    finally:
        outside.unlink()

    # THEN it is the blocks of every inode in it once: the directories' too, the link's own
    def blocks(p: Path) -> int:
        return p.lstat().st_blocks * 512

    parts = [tmp_path, tmp_path / "a", tmp_path / "sub", tmp_path / "sub" / "b", tmp_path / "link"]
    assert total == sum(blocks(p) for p in parts)
    assert total < 1_000_000
    assert nofollow.disk_blocks(dir_fd, "sub") == sum(blocks(p) for p in parts[1:4])
    assert nofollow.disk_blocks(dir_fd, "missing") == 0
