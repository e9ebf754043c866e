"""Traces of CUDA training loops (run on the GPU machine: pytest -m gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collectors.torch_trace import profiler_steps, read_trace, summarize

PROGRAM = "tests/integration/programs/train_program.py"
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("activities", [["--activities", "cpu,cuda"], []], ids=["explicit", "default"])
def test_cuda_loop_trace_holds_gpu_kernels(spawn, cli, activities):
    # GIVEN a CUDA training loop under `dynprof run`
    target = spawn([PROGRAM, "--device", "cuda", "--width", "1024", "--step-sleep", "0.002"])
    (pid,) = target.ready_pids(timeout=120)

    # WHEN three steps are traced (with CUDA activities, explicitly or by default)
    result = cli("start", "--pid", str(pid), "--steps", "3", *activities, "--json")

    # THEN the trace has three steps and GPU kernel events
    assert result.returncode == 0, result.stderr
    (res,) = json.loads(result.stdout)["results"]
    trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
    assert len(profiler_steps(trace)) == 3
    summary = summarize(trace)
    assert summary["gpu_kernel_count"] > 0, "no GPU kernels in the trace"
    print(f"\nGPU kernels traced: {summary['gpu_kernel_count']}; top: {summary['gpu_kernels'][:3]}")
    show = cli("show", res["artifact"])
    assert "top GPU kernels" in show.stdout


def test_agent_never_initialises_cuda_in_a_cpu_process(spawn, cli):
    # GIVEN a CPU-only loop on a machine with GPUs, under the agent
    target = spawn([PROGRAM, "--device", "cpu", "--step-sleep", "0.005"])
    (pid,) = target.ready_pids(timeout=120)

    # WHEN it is queried and traced with default activities
    assert cli("start", "--pid", str(pid), "--steps", "2").returncode == 0

    # THEN CUDA is still not initialised in it
    (agent,) = [a for a in json.loads(cli("ps", "--json").stdout)["agents"] if a["pid"] == pid]
    assert agent["cuda_initialized"] is False


SAFETY = "tests/integration/programs/safety_program.py"


@pytest.mark.parametrize(
    ("mode", "start_args"),
    [
        ("plain", ("--steps", "3", "--with-stack")),
        ("opt-in-backward", ("--steps", "3")),
        ("plain", ("--duration", "0.5")),
    ],
    ids=["with-stack", "opt-in-backward", "duration"],
)
def test_cuda_trace_spans_are_one_iteration_each(spawn, cli, mode, start_args):
    from collectors.torch_trace import check_step_spans

    # GIVEN a CUDA training loop (optimizers stepped in backward run on autograd's CUDA thread)
    target = spawn([SAFETY, "--mode", mode, "--device", "cuda", "--depth", "2", "--step-sleep", "0.002"])
    (pid,) = target.ready_pids(timeout=120)

    # WHEN it is traced
    result = cli("start", "--pid", str(pid), *start_args, "--activities", "cpu,cuda", "--json")

    # THEN each span the manifest does not flag partial holds the same optimizer steps, and the
    # manifest's per-span counts are the trace's
    assert result.returncode == 0, result.stderr
    (res,) = json.loads(result.stdout)["results"]
    check = check_step_spans(read_trace(Path(res["artifact"]) / "trace.json.gz"))
    summary = json.loads((Path(res["artifact"]) / "manifest.json").read_text())["summary"]
    print(
        f"\n{mode} {start_args}: {check} first/last partial {summary['first_span_partial']}/{summary['last_span_partial']}"
    )
    assert summary["optimizer_steps_per_span"] == check["per_span"], (summary, check)
    first, last = summary["first_span_partial"], summary["last_span_partial"]
    whole = check["per_span"][1 if first else 0 : len(check["per_span"]) - (1 if last else 0)]
    assert whole and len(set(whole)) == 1 and whole[0] > 0, check
    if not (first or last):
        assert check["straddling"] == 0, check
