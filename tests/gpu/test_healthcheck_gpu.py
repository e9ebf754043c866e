"""The healthcheck on real GPUs (run on the GPU machine: pytest -m gpu tests/gpu/test_healthcheck_gpu.py).

Set DYNPROF_HC_RESULTS_DIR to keep each run's JSON report there (the measured figures quoted
in docs/healthcheck.md come from these files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu

FUNCTIONAL = ("gemm_bf16", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "memory_pattern")


def healthcheck(*args: str, timeout: float = 300, name: str | None = None) -> tuple[int, dict[str, Any], float]:
    """Run ``python -m healthcheck ARGS --json`` for real; return (exit code, report, wall seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "healthcheck", *args, "--json", "--no-save"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    wall = time.monotonic() - start
    assert proc.stdout.strip(), f"no report (exit {proc.returncode}); stderr:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    report["wall_s"] = round(wall, 2)
    keep = os.environ.get("DYNPROF_HC_RESULTS_DIR")
    if keep and name:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.json").write_text(json.dumps(report, indent=1))
    return proc.returncode, report, wall


def checks(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["name"] == name]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_quick_reads_every_device_in_seconds():
    # GIVEN a node with CUDA GPUs
    n = gpu_count()

    # WHEN the quick (passive) level runs
    code, report, wall = healthcheck("--level", "quick", "--expect-devices", str(n), name="quick")

    # THEN every device was found and read and nothing critical is unknown; how long it took is
    # printed (a figure against the design's target, not a bound a busy node could break)
    print(f"\nquick: exit {code}, wall {wall:.2f} s, timings {report['timings']}")
    assert code in (0, 1, 2), report
    assert len(report["devices"]) == n
    assert checks(report, "devices")[0]["status"] == "pass"
    for name in ("ecc_mode", "ecc_errors", "row_remap", "clock_events", "temperature", "pcie_link"):
        found = checks(report, name)
        assert len(found) == n, name
        assert all(c["status"] != "unknown" for c in found), found
    assert not [c for c in report["checks"] if c["critical"] and c["status"] == "unknown"]


def test_standard_measures_every_device_and_the_allreduce():
    # GIVEN a node with CUDA GPUs
    n = gpu_count()

    # WHEN the standard (functional) level runs
    code, report, wall = healthcheck("--level", "standard", "--expect-devices", str(n), name="standard")

    # THEN each device has a measured, correct value for every functional check
    print(f"\nstandard: exit {code}, wall {wall:.2f} s, timings {report['timings']}")
    for c in report["checks"]:
        if c["metric"] or c["name"] in ("memory_pattern", "clocks_under_load", "pcie_link"):
            print(
                f"  {c['name']:<18} dev {c['device']}  {c['status']:<5} {c['value']} {c['unit'] or ''}  {c['reason']}"
            )
    for name in FUNCTIONAL:
        found = checks(report, name)
        assert len(found) == n, (name, found)
        for c in found:
            assert c["status"] != "unknown", c
            assert c["details"]["correct"] is True, c
            if c["metric"]:
                assert c["value"] > 0
    assert all(c["value"] == 0 for c in checks(report, "memory_pattern"))
    if n > 1:
        (allreduce,) = checks(report, "allreduce")
        assert allreduce["status"] != "unknown", allreduce
        assert allreduce["value"] > 0 and allreduce["details"]["world_size"] == n
    assert len(checks(report, "clocks_under_load")) == n
    # The error counters' window spans the functional checks (the devices under load)
    for c in checks(report, "pcie_replay") + checks(report, "nvlink_errors"):
        print(f"  {c['name']:<18} dev {c['device']}  {c['status']:<7} {c['value']}  {c['reason']}")
        assert c["status"] in ("pass", "skipped"), c
        if c["status"] == "pass":
            assert c["details"]["window_s"] >= report["timings"]["functional"]
    assert code in (0, 1), [c for c in report["checks"] if c["status"] in ("fail", "unknown")]


@pytest.mark.multi_gpu
def test_competing_workload_makes_a_device_fail_against_its_peers():
    # GIVEN a process that runs GEMMs on the last GPU (a device made slow)
    n = gpu_count()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(n - 1))
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, torch\n"
            "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
            "print('ready', flush=True)\n"
            "end = time.time() + 120\n"
            "while time.time() < end:\n"
            "    for _ in range(20): a @ a\n"
            "    torch.cuda.synchronize()\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"

        # WHEN the GEMM check runs on every device
        skip = "memory_bandwidth,h2d_bandwidth,d2h_bandwidth,memory_pattern,allreduce"
        code, report, _ = healthcheck("--level", "standard", "--skip", skip, name="competing_workload")
    finally:
        hog.kill()
        hog.wait(timeout=30)

    # THEN the shared device fails (slower than its peers, confirmed by a repeat), the others do not
    gemm = {c["device"]: c for c in checks(report, "gemm_bf16")}
    for c in gemm.values():
        print(
            f"\n  gemm dev {c['device']}: {c['status']} {c['value']} TFLOP/s; {c['reason']}; "
            f"attempts {c['details'].get('attempts')}"
        )
    slow = gemm[n - 1]
    assert slow["status"] == "fail", slow
    assert "slower than its" in slow["reason"]
    assert len(slow["details"]["attempts"]) == 2, "a failing measurement is repeated once"
    assert all(gemm[i]["status"] != "fail" for i in range(n - 1))
    assert code == 2


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi is not on PATH")
def test_smi_backend_reads_through_nvidia_smi():
    # GIVEN nvidia-smi, standing in for any nvidia-smi-style tool (ppu-smi)
    n = gpu_count()

    # WHEN the quick level reads the devices through it
    code, report, wall = healthcheck(
        "--backend",
        "smi",
        "--smi-tool",
        "nvidia-smi",
        "--expect-devices",
        str(n),
        "--skip",
        "pcie_link",
        name="smi_quick",
    )

    # THEN the devices and their ECC state are read; what the tool cannot give is unknown, never pass
    print(f"\nsmi: exit {code}, wall {wall:.2f} s")
    for c in report["checks"]:
        if c["device"] == 0:
            print(f"  {c['name']:<18} {c['status']:<7} {c['value']}  {c['reason']}")
    assert report["backend"] == "smi:nvidia-smi"
    assert len(report["devices"]) == n
    assert all(c["status"] in ("pass", "warn") for c in checks(report, "ecc_mode"))
    assert all(c["status"] in ("pass", "warn", "fail") for c in checks(report, "ecc_errors"))
    assert checks(report, "xid_live")[0]["status"] == "unknown"


def test_benchmarks_on_one_gpu_are_correct():
    import torch

    from healthcheck.functional.bench import gemm, host_transfer, memory_bandwidth, memory_pattern

    # GIVEN the first GPU
    device = torch.device("cuda", 0)

    # WHEN the benchmarks run with small sizes
    g = gemm(device, n=2048, warmup_s=0.1, measure_s=0.2)
    bw = memory_bandwidth(device, size_bytes=256 * 1024**2, iters=10)
    h2d, d2h = host_transfer(device, size_bytes=64 * 1024**2, iters=3)
    pattern = memory_pattern(device, fraction=0.05)

    # THEN each reports a positive figure and a correct result
    for m in (g, bw, h2d, d2h):
        assert m.ok and m.value > 0, m
    assert g.details["max_rel_error"] < 1e-2 and g.details["bitwise_stable"]
    assert pattern.ok and pattern.value == 0 and pattern.details["tested_bytes"] > 0


def test_pcie_links_read_under_load_reach_their_maximum():
    from healthcheck.backends.nvml import NvmlBackend
    from healthcheck.pcie_load import loaded_links

    # GIVEN the NVML readings of every device
    backend = NvmlBackend.open()
    try:
        readings = [backend.read(i) for i in range(backend.device_count())]

        # WHEN the links are read while host-to-device copies run
        found, why = loaded_links(backend, readings)
    finally:
        backend.close()

    # THEN every device's link is read under load, at its maximum generation and width
    print(f"\nunder load: {found}; maxima: {[(r.pcie_gen_max, r.pcie_width_max) for r in readings]}")
    assert why is None
    assert set(found) == {r.index for r in readings}
    for r in readings:
        assert found[r.index] == (r.pcie_gen_max, r.pcie_width_max)


# -- the deeper probes on real NVML ------------------------------------------------------------
def test_deeper_probes_read_real_nvml_fields_or_say_not_supported():
    from healthcheck.backends.nvml import NvmlBackend
    from healthcheck.checks.counters import RECOVERY_ACTIONS

    # GIVEN NVML on this node
    backend = NvmlBackend.open()
    try:
        # WHEN every device is read, then its counters again
        pairs = [(backend.read(i), backend.read_counters(i)) for i in range(backend.device_count())]
    finally:
        backend.close()

    # THEN each new field was read or NVML said it is not supported, never an error; counters
    # read twice did not go backwards
    for start, end in pairs:
        print(
            f"\n  dev {start.index}: recovery_action {start.recovery_action} reset_required {start.reset_required} "
            f"drain_and_reset {start.drain_and_reset_recommended} pcie_replay {start.pcie_replay_count}->"
            f"{end.pcie_replay_count} not_supported {sorted(start.not_supported)} errors {start.errors}"
        )
        new_fields = ("recovery_action", "reset_required", "drain_and_reset_recommended", "pcie_replay_count")
        assert not [f for f in new_fields if f in start.errors or f in end.errors], (start.errors, end.errors)
        assert "nvlink_counters" not in start.errors, start.errors
        if start.recovery_action is not None:
            assert start.recovery_action in RECOVERY_ACTIONS
        else:
            assert "recovery_action" in start.not_supported
        if start.pcie_replay_count is not None:
            assert end.pcie_replay_count is not None and end.pcie_replay_count >= start.pcie_replay_count >= 0
        else:
            assert "pcie_replay_count" in start.not_supported
        end_links = {link.link: link for link in end.nvlinks or []}
        for link in start.nvlinks or []:
            if not link.active:
                continue
            before, after = link.counters(), end_links[link.link].counters()
            print(f"    link {link.link}: {before} -> {after}")
            if not before:
                assert "nvlink_counters" in start.not_supported
                continue
            assert set(after) == set(before)
            assert all(after[k] - before[k] >= 0 for k in before)


def test_quick_runs_the_deeper_checks_and_none_is_unknown_on_a_healthy_node(tmp_path):
    # GIVEN a healthy node and a directory to probe as a shared filesystem
    n = gpu_count()

    # WHEN the quick level runs with every deeper check
    code, report, wall = healthcheck(
        "--level", "quick", "--expect-devices", str(n), "--shared-fs", str(tmp_path), name="quick_deep"
    )

    # THEN every device has the deeper checks, each passed or was skipped as not supported (never
    # unknown), the filesystem answered, and the whole quick check finished
    print(f"\nquick (deep): exit {code}, wall {wall:.2f} s, timings {report['timings']}")
    for name in ("recovery_action", "pcie_replay", "nvlink_errors", "ib_counters", "shared_fs"):
        for c in checks(report, name):
            print(f"  {name:<16} dev {c['device']}  {c['status']:<7} {c['value']}  {c['reason']}")
    for name in ("recovery_action", "pcie_replay", "nvlink_errors"):
        found = checks(report, name)
        assert len(found) == n, (name, found)
        for c in found:
            assert c["status"] in ("pass", "skipped"), c
            if c["status"] == "skipped":
                assert "not supported" in c["reason"] or "no NVLink" in c["reason"], c
    # InfiniBand is not NVML: a port whose narrow counter is saturated cannot be judged (unknown)
    for c in checks(report, "ib_counters"):
        assert c["status"] in ("pass", "skipped") or (c["status"] == "unknown" and "saturated" in c["reason"]), c
    (fs,) = checks(report, "shared_fs")
    assert fs["status"] == "pass", fs
    assert not [c for c in report["checks"] if c["name"] == "device_read"]
    assert code in (0, 1), [c for c in report["checks"] if c["status"] in ("fail", "unknown")]


def test_an_nvml_call_that_never_returns_is_unknown_and_named_on_real_nvml(monkeypatch, tmp_path):
    import threading

    import pynvml

    from healthcheck import runner
    from healthcheck.options import Options

    # GIVEN real NVML whose PCIe replay counter call blocks (as a hung driver call would)
    release = threading.Event()
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPcieReplayCounter", lambda handle: release.wait() and 0)
    try:
        # WHEN the quick level runs with a 2 s probe limit
        report = runner.run(
            Options(level="quick", disk_paths=["/"], min_disk_gib=0.001, probe_timeout_s=2.0, skip={"pcie_link"})
        )
    finally:
        release.set()

    # THEN every device is unknown naming the call, none passed anything, and the run returned, exit 3
    reads = [c for c in report.checks if c.name == "device_read"]
    print(f"\n  {[(c.device, c.reason) for c in reads]}")
    assert reads and len({c.device for c in reads}) == len(reads)
    assert not [c for c in report.checks if c.device is not None and c.status.value == "pass"]
    assert all(
        c.reason == "NVML call nvmlDeviceGetPcieReplayCounter did not return in 2 s (driver hung?)" for c in reads
    )
    assert report.exit_code == 3
