"""`dynprof analyze` on a job-wide trace of a 2-rank NCCL job (run on a machine with 2 GPUs:
pytest -m gpu tests/gpu/test_analyze_gpu.py -s, which also prints the table)."""

from __future__ import annotations

import json
import sys

import pytest

from tests._ports import free_port
from tests.support.ranks import rank_env

PROGRAM = "tests/integration/programs/straggler_program.py"
pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


def test_nccl_rank_with_extra_compute_is_named_and_categories_add_up(spawn, cli):
    # GIVEN a 2-rank NCCL job (one GPU per rank) where rank 1 runs 20 extra 4096x4096 matmuls
    # per step
    port = str(free_port())
    targets = []
    for rank in (0, 1):
        env = rank_env(rank, 2, port, LOCAL_RANK=str(rank), DYNPROF_JOB_ID="ncclslow")
        args = ["-m", "dynprof", "run", "-q", "--", sys.executable, PROGRAM, "--device", "cuda"]
        args += ["--width", "1024", "--slow-ranks", "1", "--load-ms", "1", "--extra-matmuls", "20"]
        args += ["--max-seconds", "120"]
        targets.append(spawn(args, under_run=False, env=env))
    for t in targets:
        t.ready_pids(timeout=180)

    # WHEN the job is traced for 5 steps and analysed
    started = cli("start", "--job", "ncclslow", "--steps", "5", "--json")
    assert started.returncode == 0, started.stderr
    table = cli("analyze", "--job", "ncclslow", "--no-save")
    print("\n" + table.stdout)
    result = cli("analyze", "--job", "ncclslow", "--json")

    # THEN rank 1 is named for its GPU compute, and every rank's categories add up to its step
    # time within 2 %
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    s = data["straggler"]
    assert s is not None and s["rank"] == 1, data["straggler_check"]
    assert "GPU compute" in s["reason"], s["reason"]
    for step in data["steps"]:
        for r in step["ranks"]:
            assert r["gpu"] is not None, "no GPU activity in the trace"
            assert sum(r["gpu"].values()) == pytest.approx(r["step_ms"], rel=0.02), r
            assert sum(r["cpu"].values()) == pytest.approx(r["step_ms"], rel=0.02), r
    assert any(k["name"].startswith("nccl") for k in data["top_kernels"]), data["top_kernels"]
