"""`dynprof analyze` on job-wide traces of real 2-rank gloo jobs, recorded during the test."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from tests._ports import free_port
from tests.support.ranks import rank_env

PROGRAM = "tests/integration/programs/straggler_program.py"


@pytest.fixture
def two_rank_job(spawn):
    """``two_rank_job(job, *program_args)`` starts a 2-rank job of straggler_program.py, each
    rank under `dynprof run` with DYNPROF_JOB_ID set; returns once both ranks have stepped."""

    def _start(job: str, *program_args: str) -> None:
        port = str(free_port())
        targets = []
        for rank in (0, 1):
            env = rank_env(rank, 2, port, LOCAL_RANK=str(rank), DYNPROF_JOB_ID=job)
            args = ["-m", "dynprof", "run", "-q", "--", sys.executable, PROGRAM, "--max-seconds", "90", *program_args]
            targets.append(spawn(args, under_run=False, env=env))
        for t in targets:
            t.ready_pids(timeout=120)

    return _start


def test_rank_with_slow_data_loading_is_named(two_rank_job, cli):
    # GIVEN a 2-rank gloo job where rank 1's load_batch takes 60 ms a step, rank 0's 1 ms
    two_rank_job("slowjob", "--slow-ranks", "1", "--load-ms", "60", "--base-load-ms", "1")

    # WHEN all its ranks are traced for 3 steps (with Python stacks) and the job is analysed
    started = cli("start", "--job", "slowjob", "--steps", "3", "--with-stack", "--json")
    assert started.returncode == 0, started.stderr
    result = cli("analyze", "--job", "slowjob", "--json")

    # THEN rank 1 is the straggler, its load_batch named, and rank 0 waits in all_reduce
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    s = data["straggler"]
    assert s is not None and s["rank"] == 1, data["straggler_check"]
    assert "load_batch" in s["reason"] and "allreduce" in s["reason"], s["reason"]
    assert s["host"] == socket.gethostname()
    r0, r1 = data["ranks"]
    assert r1["cpu"]["outside_ops"] > 40, r1
    assert r0["cpu"]["collective_wait"] > 30, r0
    for step in data["steps"]:
        for r in step["ranks"]:
            assert sum(r["cpu"].values()) == pytest.approx(r["step_ms"], rel=0.01)
    assert data["artifact"], "the analysis was not saved"
    shown = cli("show", data["artifact"])
    assert "rank 1: " in shown.stdout and "STRAGGLER on " in shown.stdout


def test_even_job_has_no_straggler(two_rank_job, cli):
    # GIVEN a 2-rank gloo job whose ranks both take 20 ms a step to load a batch
    two_rank_job("evenjob", "--load-ms", "20", "--base-load-ms", "20")

    # WHEN it is traced for 5 steps and analysed
    started = cli("start", "--job", "evenjob", "--steps", "5", "--json")
    assert started.returncode == 0, started.stderr
    result = cli("analyze", "--job", "evenjob", "--json", "--no-save")

    # THEN no straggler is named, and the noise threshold used is stated
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["straggler"] is None, data["straggler"]
    assert "noise threshold" in data["straggler_check"]
    assert len(data["ranks"]) == 2 and len(data["common_steps"]) == 5
