"""The multi-node all-reduce entry point, launched by torchrun as on a cluster (gloo on the CPU here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from healthcheck.functional.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize(("minimum", "code"), [(None, 0), (1e9, 2)])
def test_torchrun_allreduce_reports_busbw_and_gates_on_a_minimum(minimum, code, tmp_path):
    # GIVEN two ranks started by torchrun (one node here; --nnodes N across nodes), on a node
    # without numpy (a stub that refuses to import stands in front of any installed one)
    stub = tmp_path / "no-numpy" / "numpy"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    args = [
        "torchrun",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "-m",
        "healthcheck.allreduce",
        "--cpu",
        "--size-mb",
        "4",
        "--iters",
        "3",
    ]
    if minimum is not None:
        args += ["--min-busbw-gbps", str(minimum)]

    # WHEN they run the all-reduce check
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent), str(ROOT)])),
    )

    # THEN rank 0 prints one JSON result with the bus bandwidth; the exit code gates on the minimum
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    result = json.loads(lines[0])
    assert result["schema"] == "dynprof.healthcheck.allreduce"
    assert result["world_size"] == 2 and result["busbw_gbps"] > 0 and result["backend"] == "gloo"
    assert result["ok"] is (code == 0)
    assert (proc.returncode == 0) is (code == 0), proc.stderr[-2000:]
