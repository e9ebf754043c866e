"""The job comes first, on CUDA: checkpointing and a job's own profiler, traced in both modes.

Run on the GPU machine: pytest -m gpu.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from collectors.torch_trace import profiler_steps, read_trace, summarize

PROGRAM = "tests/integration/programs/safety_program.py"
JOB_LINE = re.compile(r"^(READY \d+|LOSS \d+ \S+|JOBTRACE \d+|DONE \d+)$")
pytestmark = pytest.mark.gpu


def _result(stdout: str) -> dict:
    (res,) = json.loads(stdout)["results"]
    return res


def test_cuda_checkpointing_loop_traced_in_both_modes_never_crashes(spawn, cli):
    # GIVEN a CUDA loop with activation checkpointing (backward runs Python recomputation)
    target = spawn([PROGRAM, "--mode", "checkpoint", "--device", "cuda", "--width", "1024", "--depth", "24"])
    (pid,) = target.ready_pids(timeout=180)

    # WHEN it is traced in duration mode and in step mode, again and again
    statuses = []
    kernels = []
    for i in range(8):
        args = ["--duration", "0.3"] if i % 2 == 0 else ["--steps", "2"]
        result = cli("start", "--pid", str(pid), *args, "--json")
        assert result.returncode == 0, result.stdout + result.stderr + "\n".join(target.lines[-20:])
        res = _result(result.stdout)
        statuses.append(res["status"])
        kernels.append(summarize(read_trace(Path(res["artifact"]) / "trace.json.gz"))["gpu_kernel_count"])
        assert target.proc.poll() is None

    # THEN every trace completed with GPU kernels in it, and the job only printed its own lines
    print(f"\nstatuses {statuses}; GPU kernels per trace {kernels}")
    assert statuses == ["complete"] * 8
    assert all(k > 0 for k in kernels)
    assert [
        line for line in target.lines if line and not JOB_LINE.match(line) and not line.startswith("dynprof: ")
    ] == []


def test_cuda_job_with_its_own_profiler_traced_in_both_modes_never_crashes(spawn, cli):
    # GIVEN a CUDA job whose own torch.profiler cycles and writes traces
    target = spawn([PROGRAM, "--mode", "own-profiler", "--device", "cuda", "--step-sleep", "0.02"])
    (pid,) = target.ready_pids(timeout=180)

    # WHEN dynprof is asked for step and duration traces again and again
    outcomes = []
    for i in range(8):
        args = ["--steps", "2"] if i % 2 == 0 else ["--duration", "0.2"]
        result = cli("start", "--pid", str(pid), *args, "--json", "--timeout", "60")
        if result.returncode == 6:
            outcomes.append("refused")
        else:
            res = _result(result.stdout)
            outcomes.append(res["status"])
            if res["status"] == "complete" and "--steps" in args:
                assert len(profiler_steps(read_trace(Path(res["artifact"]) / "trace.json.gz"))) == 2
        assert target.proc.poll() is None, "\n".join(target.lines[-30:])

    # THEN the job lived, its own profiler kept writing traces, and dynprof stood back
    before = len([line for line in target.lines if line.startswith("JOBTRACE")])
    after = len(target.wait_for_line("JOBTRACE", timeout=90, count=before + 1))
    print(f"\noutcomes {outcomes}; job traces {before} -> {after}")
    assert after > before
    # (with the job's profiler in use from its start, dynprof refuses: busy, the reason named)
    assert set(outcomes) <= {"complete", "partial", "refused", "failed"}
    assert "refused" in outcomes
