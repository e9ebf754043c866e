"""dynprof.attach._discover: a job's processes without agents, found by their launchers'
environment, with launchers, workers and other jobs left out (and each left-out one's reason)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from dynprof.attach._discover import JobProcess, find_job_processes
from tests.support.procs import Children, wait_exec_done

PARK = "import sys; sys.stdin.read()"  # a Python process that waits for its stdin to close
# A Python process that starts one child of its own (the same environment), says its pid, and waits.
WRAPPER = (
    "import subprocess, sys; "
    f"c = subprocess.Popen([sys.executable, '-c', {PARK!r}], stdin=subprocess.PIPE); "
    "print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()"
)


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex}"


@pytest.fixture
def start() -> Iterator[object]:
    """``start(env, code=PARK, program=python)``: a child with ``env`` added; all ended at the end."""
    children = Children()

    def _start(env: dict[str, str], code: str = PARK, argv: list[str] | None = None) -> subprocess.Popen[str]:
        return children.start(argv or [sys.executable, "-c", code], env, stdout=subprocess.PIPE, text=True)

    yield _start
    children.close()


def test_the_ranks_of_a_job_are_found_in_rank_order_and_a_rankless_one_is_a_launcher(job, start):
    # GIVEN ranks 1 and 0 of a job, and a process of it without RANK
    rank1 = start({"DYNPROF_JOB_ID": job, "RANK": "1"})  # type: ignore[operator]
    rank0 = start({"DYNPROF_JOB_ID": job, "RANK": "0"})  # type: ignore[operator]
    rankless = start({"DYNPROF_JOB_ID": job})  # type: ignore[operator]
    # WHEN the job is searched
    search = find_job_processes(job)
    # THEN the ranks are found by rank, named by the variable that matched
    assert search.job == job
    assert [(p.pid, p.rank, p.matched) for p in search.found] == [
        (rank0.pid, 0, "DYNPROF_JOB_ID"),
        (rank1.pid, 1, "DYNPROF_JOB_ID"),
    ]
    # AND the one without a rank is left out as a launcher
    assert [(p.pid, why) for p, why in search.skipped] == [(rankless.pid, "no RANK: a launcher")]


def test_a_job_is_matched_by_slurm_and_torchrun_variables_too(job, start):
    slurm = start({"SLURM_JOB_ID": job, "RANK": "0"})  # type: ignore[operator]
    torchrun = start({"TORCHELASTIC_RUN_ID": job, "RANK": "1"})  # type: ignore[operator]
    found = {p.pid: p.matched for p in find_job_processes(job).found}
    assert found == {slurm.pid: "SLURM_JOB_ID", torchrun.pid: "TORCHELASTIC_RUN_ID"}


def test_processes_of_other_jobs_and_processes_that_run_no_python_are_not_seen(job, start):
    # GIVEN a process of another job and a non-Python process of this one
    start({"DYNPROF_JOB_ID": job + "-other", "RANK": "0"})  # type: ignore[operator]
    start({"DYNPROF_JOB_ID": job, "RANK": "0"}, argv=["cat"])  # type: ignore[operator]
    # WHEN / THEN nothing is found nor skipped
    search = find_job_processes(job)
    assert search.found == [] and search.skipped == []


def test_a_wrapper_that_runs_the_script_as_its_child_is_a_launcher(job, start):
    # GIVEN a Python process of the job that runs another one as its child (no ranks anywhere)
    wrapper = start({"DYNPROF_JOB_ID": job}, code=WRAPPER)  # type: ignore[operator]
    assert wrapper.stdout is not None
    child_pid = int(wrapper.stdout.readline())
    wait_exec_done(child_pid, {"DYNPROF_JOB_ID": job})
    try:
        # WHEN the job is searched
        search = find_job_processes(job)
        # THEN the child is the process to attach, the wrapper a launcher
        assert [p.pid for p in search.found] == [child_pid]
        assert [(p.pid, why) for p, why in search.skipped] == [
            (wrapper.pid, "a launcher: it runs a process of the job as its child")
        ]
    finally:
        assert wrapper.stdin is not None
        wrapper.stdin.close()
        wrapper.wait(10)


def test_a_child_that_shares_its_parents_rank_is_left_out_as_a_worker(job, start):
    # GIVEN rank 0 that started a child of its own (which inherits RANK=0)
    rank0 = start({"DYNPROF_JOB_ID": job, "RANK": "0"}, code=WRAPPER)  # type: ignore[operator]
    assert rank0.stdout is not None
    child_pid = int(rank0.stdout.readline())
    wait_exec_done(child_pid, {"DYNPROF_JOB_ID": job, "RANK": "0"})
    try:
        search = find_job_processes(job)
        # THEN rank 0 is found, its child is left out with a reason that names rank 0's process
        assert [p.pid for p in search.found] == [rank0.pid]
        ((child, why),) = search.skipped
        assert child.pid == child_pid and str(rank0.pid) in why
    finally:
        assert rank0.stdin is not None
        rank0.stdin.close()
        rank0.wait(10)


def test_a_job_without_processes_finds_nothing(job):
    search = find_job_processes(job)
    assert (search.found, search.skipped) == ([], [])


def test_describe_names_the_rank_the_variable_and_a_cut_command_line():
    p = JobProcess(pid=12, ppid=1, matched="SLURM_JOB_ID", rank=3, cmdline=["python", "x" * 200])
    said = p.describe()
    assert said.startswith("pid 12 (rank 3, SLURM_JOB_ID): python ")
    assert len(said) <= len("pid 12 (rank 3, SLURM_JOB_ID): ") + 80
    assert "no rank" in JobProcess(pid=5, ppid=1, matched="DYNPROF_JOB_ID", rank=None).describe()
