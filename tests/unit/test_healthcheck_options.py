"""healthcheck.options: the runner's options, their document in the report, and what they decide
before any probe (the devices expected, the devices CUDA shows)."""

from __future__ import annotations

from healthcheck.compare import Thresholds
from healthcheck.options import Options, expected_devices, visible_cuda_count


def test_the_document_names_every_option_with_the_older_name_of_the_probe_limit():
    options = Options(skip={"b", "a"}, job_pids=frozenset({3, 1}), shared_fs=["/lustre"], probe_timeout_s=4.0)
    doc = options.to_json()
    assert doc["skip"] == ["a", "b"] and doc["job_pids"] == [1, 3] and doc["shared_fs"] == ["/lustre"]
    assert doc["thresholds"] == Thresholds().__dict__
    assert doc["read_timeout_s"] == doc["probe_timeout_s"] == 4.0
    assert (doc["disk_paths"], doc["xid_window_s"], doc["level"]) == (["/", "/tmp"], 3600.0, "quick")


def test_shared_filesystems_come_from_the_option_else_the_environment(monkeypatch):
    monkeypatch.setenv("DYNPROF_HEALTHCHECK_SHARED_FS", "/x::/y")
    assert Options().shared_fs_paths() == ["/x", "/y"]
    assert Options(shared_fs=[]).shared_fs_paths() == []


def test_the_devices_expected_come_from_the_option_else_the_environment(monkeypatch):
    monkeypatch.delenv("DYNPROF_EXPECT_DEVICES", raising=False)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    assert expected_devices(Options()) == (None, "")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert expected_devices(Options()) == (4, "SLURM_GPUS_ON_NODE")
    monkeypatch.setenv("DYNPROF_EXPECT_DEVICES", "8")
    assert expected_devices(Options()) == (8, "DYNPROF_EXPECT_DEVICES")
    assert expected_devices(Options(expect_devices=0)) == (0, "--expect-devices")


def test_cuda_shows_the_devices_cuda_visible_devices_names_at_most(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_cuda_count(8) == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1, ,")
    assert visible_cuda_count(8) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert visible_cuda_count(2) == 2
