"""`dynprof run --gpu-coredump`: the CUDA driver's user-triggered GPU core dump armed in the
job's environment (pipes in the runtime directory, dumps in the store), what the agent's status
and the verdict then say of it."""

from __future__ import annotations

import argparse
import stat
import sys

from dynprof.agent._gpu_step import GpuStepMarker
from dynprof.cli import _run_gpu
from dynprof.watch import gpu_side
from dynprof.watch.model import Culprit, GpuStep, RankProgress


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"gpu_coredump": False, "quiet": True, **kw})


def test_gpu_coredump_arms_the_driver_with_its_pipe_and_dumps_in_private_directories(dynprof_dirs):
    # GIVEN a job's environment
    env = {"DYNPROF_JOB_ID": "job1"}
    # WHEN `dynprof run --gpu-coredump` builds it
    _run_gpu.apply(_args(gpu_coredump=True), env)
    # THEN the driver's variables are set: the pipe per host and process in the runtime
    # directory, the dumps in the job's part of the store, a light dump that does not abort
    assert env["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1" and env["DYNPROF_GPU_COREDUMP"] == "1"
    pipe_dir = dynprof_dirs["run"] / "gpu-coredump" / "job1"
    assert env["CUDA_COREDUMP_PIPE"] == f"{pipe_dir}/corepipe.cuda.%h.%p"
    assert env["CUDA_COREDUMP_FILE"].startswith(str(dynprof_dirs["artifacts"] / "job1"))
    assert env["CUDA_COREDUMP_FILE"].endswith("/.gpu-coredump/core.cuda.%h.%p.%t")
    flags = env["CUDA_COREDUMP_GENERATION_FLAGS"].split(",")
    assert "skip_abort" in flags
    # and the constant banks are skipped with global memory (with global memory alone skipped,
    # driver 580 stops the dump after its header while a kernel runs)
    assert {"skip_global_memory", "skip_constbank_memory"} <= set(flags)
    assert stat.S_IMODE(pipe_dir.stat().st_mode) == 0o700


def test_gpu_coredump_keeps_what_the_user_set_and_says_so(dynprof_dirs, capsys):
    env = {"DYNPROF_JOB_ID": "job1", "CUDA_COREDUMP_FILE": "/scratch/core.%p"}
    _run_gpu.apply(_args(gpu_coredump=True), env)
    assert env["CUDA_COREDUMP_FILE"] == "/scratch/core.%p" and env["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1"
    assert "kept your CUDA_COREDUMP_FILE=/scratch/core.%p" in capsys.readouterr().err


def test_user_flags_that_stop_a_dump_after_its_header_are_kept_and_warned_about(dynprof_dirs, capsys):
    env = {"DYNPROF_JOB_ID": "job1", "CUDA_COREDUMP_GENERATION_FLAGS": "skip_abort,skip_global_memory"}
    _run_gpu.apply(_args(gpu_coredump=True), env)
    assert env["CUDA_COREDUMP_GENERATION_FLAGS"] == "skip_abort,skip_global_memory"
    err = capsys.readouterr().err
    assert "kept your CUDA_COREDUMP_GENERATION_FLAGS" in err and "add skip_constbank_memory" in err


def test_without_the_option_nothing_is_set():
    env = {"DYNPROF_JOB_ID": "job1"}
    _run_gpu.apply(_args(), env)
    assert env == {"DYNPROF_JOB_ID": "job1"}


def test_dynprof_run_sets_the_variables_in_the_command_it_runs(cli, dynprof_dirs):
    # GIVEN a fresh dynprof (its own process: the option is loaded by `dynprof run` itself)
    # WHEN it runs a command with --gpu-coredump, and one without
    show = (
        "import os; print(os.environ.get('CUDA_ENABLE_USER_TRIGGERED_COREDUMP'), os.environ.get('CUDA_COREDUMP_PIPE'))"
    )
    armed = cli("run", "-q", "--job-id", "cj", "--gpu-coredump", "--", sys.executable, "-c", show)
    plain = cli("run", "-q", "--job-id", "cj", "--", sys.executable, "-c", show)
    # THEN the first sees the driver's variables, the second none
    assert armed.returncode == 0, armed.stderr
    assert armed.stdout.split() == ["1", f"{dynprof_dirs['run']}/gpu-coredump/cj/corepipe.cuda.%h.%p"]
    assert plain.stdout.split() == ["None", "None"]


def test_the_status_and_the_verdict_say_whether_the_dump_is_armed_and_why_no_kernel_is_named(monkeypatch):
    # GIVEN a rank process with the dump armed, and one without
    monkeypatch.setenv("CUDA_ENABLE_USER_TRIGGERED_COREDUMP", "1")
    assert GpuStepMarker().look(None).coredump_armed is True
    monkeypatch.delenv("CUDA_ENABLE_USER_TRIGGERED_COREDUMP")
    assert GpuStepMarker().look(None).coredump_armed is False
    # WHEN the verdict's GPU evidence is made for each
    culprit = Culprit(rank=1, host="n1", where="?", why="?", pid=7)

    def kernel_of(armed: bool) -> str:
        row = RankProgress(job="j", rank=1, world_size=2, pid=7, host="n1", last_step_age_s=30.0)
        row.gpu_step = GpuStep(step=4, done=False, age_s=30.0, coredump_armed=armed)
        (item,) = gpu_side.evidence("hang", [culprit], [("n1", row)])
        return str(item["kernel"])

    # THEN it says why the kernel is not named: not armed (and how to arm it), or armed but
    # not triggered by dynprof
    assert kernel_of(False) == gpu_side.KERNEL_NOT_ARMED and "dynprof run --gpu-coredump" in kernel_of(False)
    assert kernel_of(True) == gpu_side.KERNEL_ARMED and "dynprof watch --gpu-coredump" in kernel_of(True)
