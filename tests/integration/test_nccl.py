"""`dynprof nccl` on a real hung 2-rank job (gloo: torch's flight recorder covers Gloo since 2.8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.flight_recorder import detect_environment

HANG = "tests/integration/programs/hang_program.py"


def test_nccl_names_the_missing_rank_and_the_collective(hang_job, cli):
    if not detect_environment().names & {"TORCH_FR_BUFFER_SIZE"}:
        pytest.skip("this torch has no flight recorder for Gloo (CPU); see tests/gpu/test_hang_gpu.py")
    # GIVEN a job started with the flight recorder where rank 1 never enters rank 0's all_reduce
    hang_job("frjob", run_args=["--flight-recorder", "64"])

    # WHEN every rank's recorder is collected
    result = cli("nccl", "--job", "frjob", "--json")

    # THEN the default group is hung in all_reduce and rank 1 is missing from it
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    (pg,) = out["analysis"]["process_groups"]
    assert pg["hung"] and pg["waiting"] == [0] and pg["missing"] == [1]
    assert "all_reduce" in pg["collective"] and "collective_wait" in pg["collective"]
    art = Path(out["artifact"])
    assert {"analysis.json", "analysis.txt"} <= {p.name for p in art.iterdir()}
    assert len(list(art.glob("rank*-pid*.json"))) == 2
    text = cli("nccl", "--job", "frjob")
    assert "HUNG: rank 0 wait in #" in text.stdout and "missing: rank 1" in text.stdout
    shown = cli("show", str(art))
    assert "missing: rank 1" in shown.stdout


def test_job_without_the_recorder_gets_a_clear_message(hang_job, cli):
    hang_job("plainjob")
    result = cli("nccl", "--job", "plainjob")
    assert result.returncode == 7, result.stderr
    assert "flight recorder is off" in result.stderr
    assert "dynprof run --flight-recorder" in result.stderr
    # and no artifact is left of the attempt (a watch asks at every hang verdict)
    listed = cli("ls", "--job", "plainjob", "--kind", "nccl", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["artifacts"] == []
