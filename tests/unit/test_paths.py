"""dynprof.paths: the private runtime directory and the artifact directory, and their refusals."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dynprof import paths
from dynprof.errors import DynprofError, PermissionDenied


def test_the_run_dir_is_dynprof_run_dir_and_is_made_private(tmp_path, monkeypatch):
    # GIVEN DYNPROF_RUN_DIR naming a directory that does not exist yet
    where = tmp_path / "a" / "run"
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(where))
    # WHEN it is asked for
    found = paths.run_dir()
    # THEN it is that directory, created 0700
    assert found == where
    assert stat.S_IMODE(where.stat().st_mode) == 0o700


def test_run_dir_without_create_makes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(tmp_path / "later"))
    assert paths.run_dir(create=False) == tmp_path / "later"
    assert not (tmp_path / "later").exists()


def test_without_an_override_the_run_dir_is_under_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNPROF_RUN_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.run_dir(create=False) == tmp_path / "dynprof"


def test_a_missing_xdg_runtime_dir_falls_back_to_tmp_by_uid(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNPROF_RUN_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "absent"))
    assert paths.run_dir(create=False) == Path(f"/tmp/dynprof-{os.getuid()}")


def test_an_existing_dir_open_to_others_is_made_private(tmp_path):
    # GIVEN a directory of ours with mode 0777
    where = tmp_path / "open"
    where.mkdir()
    os.chmod(where, 0o777)
    # WHEN it is checked
    paths.ensure_private_dir(where)
    # THEN it is 0700 now
    assert stat.S_IMODE(where.stat().st_mode) == 0o700


def test_a_file_in_the_way_is_a_dynprof_error_that_says_so(tmp_path):
    # GIVEN a file where a directory above the run dir should be
    (tmp_path / "f").write_text("")
    # WHEN / THEN the user reads what is wrong, not a traceback
    with pytest.raises(DynprofError, match="is a file"):
        paths.ensure_private_dir(tmp_path / "f" / "run")
    with pytest.raises(DynprofError, match="is a file"):
        paths.ensure_private_dir(tmp_path / "f")


def test_a_link_to_a_directory_is_not_a_runtime_directory(tmp_path):
    # GIVEN a symlink to a real directory
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    # WHEN / THEN it is refused: the check looks at the link itself
    with pytest.raises(DynprofError, match="not a directory"):
        paths.ensure_private_dir(tmp_path / "link")


def test_a_directory_of_another_user_is_permission_denied(tmp_path, monkeypatch):
    # GIVEN a directory that appears to belong to another uid
    where = tmp_path / "theirs"
    where.mkdir()
    monkeypatch.setattr(paths.os, "getuid", lambda: where.stat().st_uid + 1)
    # WHEN / THEN it is refused with the owner named
    with pytest.raises(PermissionDenied, match=f"belongs to uid {where.stat().st_uid}"):
        paths.ensure_private_dir(where)


def test_agents_and_logs_dirs_are_private_subdirectories(dynprof_dirs):
    assert paths.agents_dir() == dynprof_dirs["run"] / "agents"
    assert paths.logs_dir() == dynprof_dirs["run"] / "logs"
    for sub in ("agents", "logs"):
        assert stat.S_IMODE((dynprof_dirs["run"] / sub).stat().st_mode) == 0o700


def test_the_artifact_dir_is_the_override_else_under_xdg_data_home(tmp_path, monkeypatch, dynprof_dirs):
    assert paths.artifact_dir() == dynprof_dirs["artifacts"]
    monkeypatch.delenv("DYNPROF_ARTIFACT_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert paths.artifact_dir() == tmp_path / "dynprof" / "artifacts"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.artifact_dir() == tmp_path / "home" / ".local" / "share" / "dynprof" / "artifacts"
