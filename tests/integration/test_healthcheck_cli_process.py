"""`dynprof healthcheck` end to end, as a real process, on whatever machine the tests run on.

On a machine without accelerators (CI) it must say so, exit 3 unless told to expect none, and
still run the host checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def has_accelerator() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0
    except Exception:
        return False


no_accelerator = pytest.mark.skipif(has_accelerator(), reason="this machine has an accelerator")


def dynprof(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.pop("SLURM_GPUS_ON_NODE", None)
    full_env.pop("DYNPROF_EXPECT_DEVICES", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dynprof", "healthcheck", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
        cwd=str(ROOT),
    )


@no_accelerator
def test_without_accelerator_it_says_so_and_exits_3_after_the_host_checks():
    # GIVEN a machine without accelerators
    # WHEN the healthcheck runs with its defaults
    proc = dynprof("--no-save")

    # THEN it names what it tried, exits 3, and the host checks still ran
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "accelerators" in proc.stdout and "UNKNOWN" in proc.stdout
    assert "no accelerator found" in proc.stdout and "nvml" in proc.stdout
    assert "what to do:" in proc.stdout and "--expect-devices 0" in proc.stdout
    for host_check in ("disk_free", "shm_size", "host_memory", "host_processes"):
        assert host_check in proc.stdout
    assert "verdict: COULD NOT RUN (exit 3)" in proc.stdout


@no_accelerator
def test_expecting_no_device_runs_the_host_checks_only(tmp_path):
    # GIVEN a machine without accelerators, where none is expected
    prom = tmp_path / "dynprof.prom"

    # WHEN the healthcheck runs with --expect-devices 0, JSON and a Prometheus file
    proc = dynprof(
        "--expect-devices", "0", "--json", "--prometheus", str(prom), "--disk", str(tmp_path), "--min-disk-gib", "0.01"
    )

    # THEN the JSON report and the exit code agree, host checks decide, and the artifact was saved
    report = json.loads(proc.stdout)
    assert report["schema"] == "dynprof.healthcheck" and report["schema_version"] == 1
    assert proc.returncode == report["exit_code"]
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["accelerators"] == "pass"
    assert {"disk_free", "shm_size", "host_memory", "host_processes", "ib_ports"} <= set(statuses)
    assert report["exit_code"] in (0, 1)  # healthy, or a host warning such as a small /dev/shm
    artifact = Path(report["artifact"])
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kind"] == "healthcheck" and manifest["status"] == "complete"
    assert manifest["summary"]["exit_code"] == report["exit_code"]
    assert json.loads((artifact / "results.json").read_text())["checks"] == report["checks"]
    assert f'dynprof_healthcheck_exit_code{{host="{report["host"]}",level="quick"}} {report["exit_code"]}' in (
        prom.read_text()
    )


def test_usage_errors_exit_3_not_2_which_means_unhealthy():
    proc = dynprof("--level", "thorough")
    assert proc.returncode == 3
    assert "invalid choice" in proc.stderr


def test_python_dash_m_healthcheck_is_the_same_command():
    proc = subprocess.run(
        [sys.executable, "-m", "healthcheck", "--help"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0
    assert "Exit codes: 0 healthy, 1 warning, 2 unhealthy (drain the node), 3 could not run." in proc.stdout


@no_accelerator
def test_smi_backend_with_a_missing_tool_is_could_not_run():
    proc = dynprof("--backend", "smi", "--smi-tool", "ppu-smi-not-installed", "--json", "--no-save")
    report = json.loads(proc.stdout)
    assert proc.returncode == 3
    (acc,) = [c for c in report["checks"] if c["name"] == "accelerators"]
    assert "ppu-smi-not-installed: not found on PATH" in acc["reason"]
