"""The host's own functional figures (healthcheck.functional.cpu): measured on this machine's
CPU, correct, and reported by a standard run on a node without accelerators, so that such nodes
have figures the job-wide peer comparison can use."""

from __future__ import annotations

from healthcheck import runner
from healthcheck.backends import NoAccelerator
from healthcheck.functional.cpu import host_gemm, host_memory_bandwidth
from healthcheck.functional.table import HOST_FUNCTIONAL_CHECKS
from healthcheck.options import Options
from healthcheck.result import Status


def test_the_host_figures_are_measured_and_correct():
    # WHEN the two host benchmarks run small
    gemm = host_gemm(n=128, measure_s=0.05, repeats=3, warmup_s=0.01)
    copy = host_memory_bandwidth(size_bytes=4 * 1024**2, iters=2, repeats=3)

    # THEN each is a positive figure with its metric, judged correct, grouped by the CPU model
    assert (gemm.check, gemm.metric, gemm.unit) == ("host_gemm_fp32", "host_gemm_fp32_gflops", "GFLOP/s")
    assert (copy.check, copy.metric, copy.unit) == ("host_memory_bandwidth", "host_memory_bandwidth_gbps", "GB/s")
    for m in (gemm, copy):
        assert m.ok and m.value > 0 and m.details["threads"] == 1
        assert str(m.details["peer_group"]).startswith("cpu ")
    assert gemm.details["max_rel_error"] <= 1e-4
    assert round(gemm.value, 1) == max(gemm.details["all_gflops"])  # the best run


def test_a_standard_run_without_accelerators_reports_the_host_figures(monkeypatch):
    # GIVEN a node with no accelerator, and none expected
    def no_backend(kind, tool):
        raise NoAccelerator("no accelerator here")

    monkeypatch.setattr(runner, "open_backend", no_backend)

    # WHEN the standard level runs (a real CPU worker process)
    report = runner.run(Options(level="standard", expect_devices=0, disk_paths=["/"], min_disk_gib=0.001))

    # THEN both host figures are there, measured, node-level, and pass without a baseline
    figures = {c.name: c for c in report.checks if c.name.startswith("host_") and c.metric}
    assert set(figures) == {"host_gemm_fp32", "host_memory_bandwidth"}
    for c in figures.values():
        assert c.status is Status.PASS and c.device is None and isinstance(c.value, float) and c.value > 0
    assert "host_functional" in report.timings


def test_quick_runs_no_host_figure_and_skip_leaves_them_out(monkeypatch):
    monkeypatch.setattr(runner, "open_backend", lambda kind, tool: (_ for _ in ()).throw(NoAccelerator("none")))
    quick = runner.run(Options(level="quick", expect_devices=0, disk_paths=["/"], min_disk_gib=0.001))
    skipped = runner.run(
        Options(
            level="standard",
            expect_devices=0,
            disk_paths=["/"],
            min_disk_gib=0.001,
            skip={"host_gemm_fp32", "host_memory_bandwidth"},
        )
    )
    for report in (quick, skipped):
        assert not [c for c in report.checks if c.name in HOST_FUNCTIONAL_CHECKS]
