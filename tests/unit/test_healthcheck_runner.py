"""The whole run on a simulated node: a fake backend and CPU workers standing in for GPUs.

The measurement layer is real (worker processes timing GEMMs and copies on the CPU); the
backend's readings are fixed, and where a test needs a slow device its measurements are
scaled down as they leave the workers.
"""

from __future__ import annotations

from typing import Any

import pytest

from healthcheck import runner as runner_mod
from healthcheck.arguments import add_check_arguments, request_from_args
from healthcheck.backends.base import XidEvent
from healthcheck.functional import launcher
from healthcheck.options import Options
from healthcheck.readings import DeviceReadings
from healthcheck.result import Status
from tests.support.readings import healthy_readings

_real_run = launcher.run_workers

# The GEMM throughput of a simulated device (see the node fixture).
SIMULATED_TFLOPS = 100.0

SMALL = launcher.LevelPlan(
    params={
        "gemm_bf16": {"n": 256, "warmup_s": 0.05, "measure_s": 0.15, "repeats": 3},
        "memory_bandwidth": {"size_bytes": 8 * 1024**2, "warmup_s": 0.02, "iters": 5},
        "host_transfer": {"size_bytes": 4 * 1024**2, "iters": 3},
        "memory_pattern": {"fraction": 0.5, "chunk_bytes": 8 * 1024**2, "free_bytes": 32 * 1024**2},
        "allreduce": {"size_bytes": 4 * 1024**2, "warmup": 1, "iters": 3},
    },
    timeouts={"gemm_bf16": 60, "memory_bandwidth": 60, "host_transfer": 60, "memory_pattern": 60, "allreduce": 90},
)


def healthy(index: int) -> DeviceReadings:
    return healthy_readings(index, links=4, driver_version="999.1", ecc_corrected_volatile=0)


class FakeBackend:
    name = "fake"

    def __init__(self, readings: list[DeviceReadings], xids: list[XidEvent] | None = None) -> None:
        self.readings = readings
        self.xids = xids or []

    def device_count(self) -> int:
        return len(self.readings)

    def driver_version(self) -> str | None:
        return "999.1"

    def read(self, index: int) -> DeviceReadings:
        return self.readings[index]

    def read_pcie(self, index: int) -> tuple[int | None, int | None]:
        return self.readings[index].pcie_gen_max, self.readings[index].pcie_width_max

    def read_counters(self, index: int) -> DeviceReadings:
        return self.readings[index]

    def watch_xid(self) -> bool:
        return True

    def xid_events(self) -> list[XidEvent]:
        return self.xids

    def close(self) -> None:
        pass


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch):
    """Install a fake node; returns a function to set its readings and a slow-device factor."""
    state: dict[str, Any] = {"slow": {}}

    def install(
        readings: list[DeviceReadings], xids: list[XidEvent] | None = None, slow: dict[int, float] | None = None
    ):
        backend = FakeBackend(readings, xids)
        state["slow"] = slow or {}
        monkeypatch.setattr(runner_mod, "open_backend", lambda kind, tool: backend)
        monkeypatch.setattr(runner_mod.xidlog, "read_kernel_log_xids", lambda window, now=None: ([], "test log"))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        return backend

    real_run_workers = launcher.run_workers

    def cpu_workers(local_ranks, checks, plan, **kwargs):
        kwargs["device_type"] = "cpu"
        outcomes, identities = real_run_workers(local_ranks, checks, SMALL, **kwargs)
        for outcome in outcomes:
            # The simulated devices' GEMM throughput is set here, not taken from the CPU workers'
            # figures: two workers sharing a loaded 2-core machine can differ by more than any
            # simulated slowdown. The workers still ran the real GEMM (its correctness is checked).
            factor = state["slow"].get(outcome.local_rank, 1.0)
            for m in outcome.measurements:
                if m.metric == "gemm_bf16_tflops" and m.ok and m.value > 0:
                    m.details["measured_tflops"] = m.value
                    m.value = SIMULATED_TFLOPS * factor
        for ident in identities:
            ident.uuid = f"GPU-{ident.local_rank}"
        return outcomes, identities

    monkeypatch.setattr(launcher, "run_workers", cpu_workers)
    return install


def by_name(report, name):
    return [c for c in report.checks if c.name == name]


def test_quick_on_a_healthy_node_is_exit_0(node):
    # GIVEN two healthy devices, two expected
    node([healthy(0), healthy(1)])

    # WHEN the quick level runs
    report = runner_mod.run(Options(level="quick", expect_devices=2, disk_paths=["/"], min_disk_gib=0.001))

    # THEN every device check passed or was skipped as not applicable
    device_checks = [c for c in report.checks if c.device is not None]
    assert {c.status for c in device_checks} <= {Status.PASS, Status.SKIPPED}
    assert {c.name for c in device_checks} >= {"ecc_errors", "row_remap", "pcie_link", "nvlink", "clock_events"}
    assert by_name(report, "retired_pages")[0].status is Status.SKIPPED  # the device remaps rows
    assert report.exit_code in (0, 1)  # the host (this machine) decides between the two
    if all(c.status in (Status.PASS, Status.SKIPPED) for c in report.checks):
        assert report.exit_code == 0


def test_a_missing_device_fails_and_a_pending_remap_names_reset(node):
    # GIVEN one of two expected devices, with a pending row remap
    bad = healthy(0)
    bad.remap_pending = True
    node([bad])

    # WHEN the quick level runs
    report = runner_mod.run(Options(level="quick", expect_devices=2, disk_paths=["/"], min_disk_gib=0.001))

    # THEN the node is unhealthy (exit 2) and the device needs a reset
    assert by_name(report, "devices")[0].status is Status.FAIL
    assert by_name(report, "row_remap")[0].action == "reset"
    assert report.exit_code == 2
    assert report.device_actions() == {"node": "drain", "0": "reset"}


def test_live_xid_during_the_run_fails_the_device(node):
    # GIVEN a device that reports XID 79 while the healthcheck runs
    node([healthy(0), healthy(1)], xids=[XidEvent(device=1, xid=79)])

    # WHEN the quick level runs
    report = runner_mod.run(Options(level="quick", disk_paths=["/"], min_disk_gib=0.001))

    # THEN that device fails with the drain action
    live = {c.device: c for c in by_name(report, "xid_live")}
    assert live[0].status is Status.PASS
    assert live[1].status is Status.FAIL and live[1].action == "drain"


@pytest.mark.slow
def test_standard_measures_each_device_and_flags_a_slow_one(node, monkeypatch):
    # GIVEN two devices, the second one's GEMM throughput made 30 % lower at the measurement layer
    # (one CPU thread per worker, so that the CPU "devices" do not compete with each other)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    node([healthy(0), healthy(1)], slow={1: 0.7})

    # WHEN the standard level runs (real worker processes, on the CPU)
    report = runner_mod.run(Options(level="standard", disk_paths=["/"], min_disk_gib=0.001))

    # THEN every device was measured, the slow one fails against its peers after one repeat
    gemm = {c.device: c for c in by_name(report, "gemm_bf16")}
    assert set(gemm) == {0, 1}
    assert gemm[1].status is Status.FAIL, gemm[1]
    assert "slower than its 1 peers" in gemm[1].reason
    assert len(gemm[1].details["attempts"]) == 2
    assert gemm[0].status is not Status.FAIL, gemm[0]
    for name in ("memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "memory_pattern"):
        assert len(by_name(report, name)) == 2 and all(c.status is not Status.UNKNOWN for c in by_name(report, name))
    (allreduce,) = by_name(report, "allreduce")
    assert allreduce.details["world_size"] == 2 and allreduce.details["correct"] is True
    assert all(c.status is Status.PASS for c in by_name(report, "pcie_link"))  # read during the transfer test
    assert report.exit_code == 2


@pytest.mark.slow
def test_a_check_that_outlives_its_timeout_is_unknown_not_pass(node, monkeypatch):
    # GIVEN a GEMM that runs far longer than its timeout allows
    node([healthy(0)])
    slow_plan = launcher.LevelPlan(
        params={**SMALL.params, "gemm_bf16": {"n": 512, "warmup_s": 60.0, "measure_s": 60.0}},
        timeouts={**SMALL.timeouts, "gemm_bf16": 1.0},
    )

    def with_slow_plan(local_ranks, checks, plan, **kwargs):
        return _real_run(local_ranks, checks, slow_plan, **{**kwargs, "device_type": "cpu"})

    monkeypatch.setattr(launcher, "run_workers", with_slow_plan)

    # WHEN the standard level runs
    report = runner_mod.run(Options(level="standard", disk_paths=["/"], min_disk_gib=0.001))

    # THEN the GEMM is unknown with the timeout as reason, the checks after it did not run, exit 3
    (gemm,) = by_name(report, "gemm_bf16")
    assert gemm.status is Status.UNKNOWN and "timed out after 1 s" in gemm.reason
    (bandwidth,) = by_name(report, "memory_bandwidth")
    assert bandwidth.status is Status.UNKNOWN and bandwidth.reason.startswith("not run")
    assert report.exit_code == 3


def test_the_processes_of_the_job_named_are_not_others_holding_the_devices(node, monkeypatch):
    # GIVEN a device held by a rank of job "hjob" (a live process with a dynprof agent here) and
    # by a process of no job, and a process of another job with an agent
    import argparse
    import os
    import subprocess

    from dynprof.registry import AgentRecord, write_record
    from healthcheck.readings import DeviceProcess
    from tests.support.records import agent_record

    def record(pid: int, job: str) -> AgentRecord:
        return agent_record(pid, rank=0, world_size=1, job_id=job)

    rank = subprocess.Popen(["sleep", "120"])  # a live process: the job's rank
    try:
        rank_pid, stranger = rank.pid, os.getppid()
        write_record(record(rank_pid, "hjob"))
        write_record(record(stranger, "other"))
        held = healthy(0)
        held.processes = [DeviceProcess(rank_pid, 1 << 30), DeviceProcess(stranger, 1 << 30)]
        node([held])

        # WHEN the quick level runs for job hjob (as a watch's verdict asks), and for no job
        parser = argparse.ArgumentParser()
        add_check_arguments(parser)
        argv = ["--job", "hjob", "--disk", "/", "--min-disk-gib", "0.001"]
        options = request_from_args(parser.parse_args(argv)).options()
        for_job = runner_mod.run(options)
        for_none = runner_mod.run(Options(level="quick", disk_paths=["/"], min_disk_gib=0.001))
    finally:
        rank.kill()
        rank.wait(timeout=30)

    # THEN the job's rank is its own, the other process is still named; without a job, both are
    assert options.job_pids == frozenset({rank_pid})
    (check,) = by_name(for_job, "device_processes")
    assert check.status is Status.WARN
    assert [p["pid"] for p in check.details["processes"]] == [stranger]
    (check,) = by_name(for_none, "device_processes")
    assert [p["pid"] for p in check.details["processes"]] == [rank_pid, stranger]
    assert for_job.options["job_pids"] == [rank_pid]
