"""healthcheck.checks.shared_fs: the mount holding a path (read from /proc/mounts text, never
touching the path), and each probe's report judged; children here are small shell scripts that
print what a probe would, and one real probe of tmp_path."""

from __future__ import annotations

import json
import shlex

import pytest

from healthcheck.checks.shared_fs import PROBE_BYTES, SharedFsProbe, mount_of, start_probes
from healthcheck.result import Status

MOUNTS = """\
/dev/sda1 / ext4 rw 0 0
server:/export /mnt/data nfs4 rw 0 0
server:/export/deep /mnt/data/deep lustre rw 0 0
tmpfs /mnt/with\\040space tmpfs rw 0 0
garbage
"""


def test_the_longest_mount_point_over_a_path_wins():
    assert mount_of("/mnt/data/deep/x/y", MOUNTS) == {
        "mount_point": "/mnt/data/deep",
        "fstype": "lustre",
        "source": "server:/export/deep",
    }
    assert mount_of("/mnt/data/x", MOUNTS)["fstype"] == "nfs4"


def test_a_mount_point_is_matched_whole_not_as_a_prefix_of_a_name():
    # /mnt/database is not under /mnt/data
    assert mount_of("/mnt/database", MOUNTS)["mount_point"] == "/"


def test_the_mount_point_itself_is_under_its_mount():
    assert mount_of("/mnt/data", MOUNTS)["fstype"] == "nfs4"


def test_escaped_spaces_in_mount_points_are_read():
    assert mount_of("/mnt/with space/f", MOUNTS)["fstype"] == "tmpfs"


def test_a_path_under_no_mount_gives_none():
    assert mount_of("/x", "server:/e /mnt/data nfs rw 0 0\n") is None


def test_relative_paths_are_made_absolute_first(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    text = f"tmpfs {tmp_path} tmpfs rw 0 0\n"
    assert mount_of("sub/dir", text)["mount_point"] == str(tmp_path)


def scripted(output: str, limit_s: float = 5.0, path: str = "/mnt/data", then: str = "") -> SharedFsProbe:
    """A probe whose child prints ``output`` (then runs ``then``)."""
    script = f"printf %s {shlex.quote(output)}; {then}"
    return SharedFsProbe(path, limit_s, argv=["/bin/sh", "-c", script]).start()


def report(**fields) -> str:
    return "step statvfs\n" + json.dumps({"steps": {"statvfs": 0.001}, **fields}) + "\n"


def test_a_probe_that_answers_every_step_passes_in_milliseconds():
    steps = {"statvfs": 0.001, "create": 0.002, "write": 0.003, "read": 0.001, "unlink": 0.001}
    probe = scripted(json.dumps({"steps": steps, "data_matches": True, "free_bytes": 10, "total_bytes": 20}) + "\n")
    result = probe.result(MOUNTS)
    assert (result.status, result.value, result.unit) == (Status.PASS, 8.0, "ms")
    assert result.details["mount"]["fstype"] == "nfs4"
    assert result.details["free_bytes"] == 10


@pytest.mark.parametrize(
    ("errno", "status", "words"),
    [
        ("ENOENT", Status.FAIL, "not there (not mounted?)"),
        ("EIO", Status.FAIL, "does not answer statvfs"),
        ("EACCES", Status.UNKNOWN, "does not answer statvfs"),
    ],
)
def test_a_statvfs_failure_is_judged_by_its_errno(errno, status, words):
    result = scripted(report(failed="statvfs", errno=errno, error="boom")).result(MOUNTS)
    assert result.status is status
    assert words in result.reason and f"({errno})" in result.reason
    assert result.action == ("drain" if status is Status.FAIL else None)


@pytest.mark.parametrize("errno", ["EROFS", "EACCES", "EPERM"])
def test_a_filesystem_that_answers_but_will_not_take_the_probe_file_only_warns(errno):
    result = scripted(report(failed="create", errno=errno, error="Read-only file system")).result(MOUNTS)
    assert result.status is Status.WARN
    assert "give a writable directory" in result.reason


def test_a_write_that_fails_with_an_io_error_fails_and_drains():
    result = scripted(report(failed="write", errno="EIO", error="Input/output error")).result(MOUNTS)
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert "write failed: Input/output error (EIO)" in result.reason


def test_data_read_back_different_fails():
    result = scripted(report(data_matches=False)).result(MOUNTS)
    assert result.status is Status.FAIL and "differs" in result.reason


@pytest.mark.parametrize("output", ["", "step statvfs\n", "[1, 2]\n", "{not json\n"])
def test_a_probe_without_a_report_is_unknown_with_its_exit_code(output):
    result = scripted(output, then="exit 7").result(MOUNTS)
    assert result.status is Status.UNKNOWN
    assert "(exit 7)" in result.reason


def test_a_probe_stuck_in_a_step_fails_naming_the_step_and_is_killed():
    # GIVEN a child that names "create" and then never ends
    probe = scripted("step statvfs\nstep create\n", limit_s=0.2, then="exec sleep 30")
    # WHEN collected
    result = probe.result(MOUNTS)
    # THEN the step it was in is named, the node drains, and the child is killed
    assert (result.status, result.action) == (Status.FAIL, "drain")
    assert "create did not return in 0.2 s" in result.reason
    assert result.details["step"] == "create"
    assert probe.proc is not None and probe.proc.wait(5) != 0


def test_a_child_that_cannot_start_is_unknown():
    probe = SharedFsProbe("/mnt/data", 1.0, argv=["/nonexistent/probe"]).start()
    result = probe.result(MOUNTS)
    assert result.status is Status.UNKNOWN and "cannot start the probe" in result.reason


def test_a_probe_never_started_is_unknown():
    assert SharedFsProbe("/mnt/data", 1.0).result(MOUNTS).status is Status.UNKNOWN


def test_a_flood_of_output_is_bounded():
    # GIVEN a child writing megabytes before its report
    probe = SharedFsProbe(
        "/mnt/data", 5.0, argv=["/bin/sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; printf '\\n%s\\n' '{}'"]
    ).start()
    result = probe.result(MOUNTS)
    # THEN only a bounded tail is kept, and an empty report is no report
    assert len(probe.output) <= 64 * 1024
    assert result.status is Status.UNKNOWN


def test_the_real_probe_passes_on_a_local_directory_and_leaves_no_file(tmp_path):
    [probe] = start_probes([str(tmp_path)], 10.0)
    result = probe.result()
    assert result.status is Status.PASS, result.reason
    assert f"{PROBE_BYTES // 1024} KiB write" in result.reason
    assert list(tmp_path.iterdir()) == []
    assert set(result.details["steps"]) == {"statvfs", "create", "write", "read", "unlink"}


def test_the_real_probe_of_a_missing_path_fails_as_not_there(tmp_path):
    [probe] = start_probes([str(tmp_path / "absent")], 10.0)
    result = probe.result()
    assert result.status is Status.FAIL and "not there" in result.reason
