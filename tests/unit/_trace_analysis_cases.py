"""Traces the unit tests of :mod:`collectors.trace_analysis` (and of ``dynprof analyze``) read:
the recorded gloo jobs (tests/unit/data/traces, recorded by tests/data/record_gloo_traces.py),
the recorded GPU pairs (tests/data/gpu_traces) and small synthetic GPU traces built here."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from collectors.trace_analysis.job import combine
from collectors.trace_analysis.rank import RankInput, analyze_ranks
from dynprof.store import ArtifactStore

TRACES = Path(__file__).parent / "data" / "traces"
# GPU traces of a 2-rank gloo job sharing one H200 (gradients all-reduced on the CPU), as
# `dynprof start --job J --steps 6` wrote them (tests/gpu/programs/gpu_fault_program.py)
GPU_TRACES = Path(__file__).resolve().parents[1] / "data" / "gpu_traces"


def trace_files(name: str) -> list[Path]:
    return sorted((TRACES / name).glob("*/*/rank*/trace/*/trace.json.gz"))


def analyze(name: str) -> dict:
    files = trace_files(name)
    assert len(files) == 2, files
    return combine(analyze_ranks([RankInput(str(f)) for f in files], workers=1))


def gpu_case(case: str, device: str | None = None) -> dict:
    files = sorted(GPU_TRACES.glob(f"{case}-*.json.gz"))
    assert len(files) == 2
    return combine(analyze_ranks([RankInput(path=str(f), device=device) for f in files], workers=1))


def copy_traces(root: Path, *names: str) -> ArtifactStore:
    """Copy recorded fixture artifacts into the store at ``root``; returns the store."""
    for name in names:
        shutil.copytree(TRACES / name, root, dirs_exist_ok=True)
    return ArtifactStore(root)


def assert_categories_add_up(analysis: dict) -> None:
    for step in analysis["steps"]:
        for r in step["ranks"]:
            cpu = sum(r["cpu"].values())
            assert cpu == pytest.approx(r["step_ms"], rel=1e-3, abs=0.01), (step["step"], r)
            if r["gpu"] is not None:
                assert sum(r["gpu"].values()) == pytest.approx(r["step_ms"], rel=1e-3, abs=0.01), r


def gpu_trace(
    path: Path,
    rank: int,
    compute_us: float = 4000,
    comm_start: float = 4000,
    comm_us: float = 3000,
    grid: list[int] | None = None,
    copy_bytes: int | None = None,
) -> Path:
    """A synthetic trace (not recorded), in Kineto's schema: per 10 ms step, a compute kernel from
    1 ms, an NCCL all-reduce on another stream, a memcpy at 6.5-8 ms and a kernel on a third
    stream at 9-9.5 ms; CPU ops on the main thread; the GPU copies of ProfilerStep spans."""
    events: list[dict] = []

    def x(cat: str, name: str, pid: int, tid: int, ts: float, dur: float) -> None:
        e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        if grid is not None and cat == "kernel":
            e["args"] = {"grid": grid, "block": [128, 1, 1], "device": 0}
        if copy_bytes is not None and cat == "gpu_memcpy":
            e["args"] = {"bytes": copy_bytes, "device": 0}
        events.append(e)

    for k in range(3):
        t = 1_000_000.0 + k * 10_000
        x("user_annotation", f"ProfilerStep#{k + 5}", 7, 7, t, 10_000)
        x("cpu_op", "aten::mm", 7, 7, t + 100, 800)
        x("cuda_runtime", "cudaLaunchKernel", 7, 7, t + 200, 20)
        x("cpu_op", "record_param_comms", 7, 7, t + 1000, 50)
        x("gpu_user_annotation", f"ProfilerStep#{k + 5}", 0, 7, t + 900, 9000)
        x("kernel", "ampere_sgemm_128x64_tn", 0, 7, t + 1000, compute_us)
        x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 20, t + comm_start, comm_us)
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 21, t + 6500, 1500)
        x("kernel", "elementwise_kernel", 0, 22, t + 9000, 500)
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}}
    doc["traceEvents"] = events
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def write_events(path: Path, events: list[dict], **header: object) -> Path:
    """A gzipped Chrome trace of ``events`` (and the top-level keys ``header``) at ``path``."""
    path.write_bytes(gzip.compress(json.dumps({**header, "traceEvents": events}).encode()))
    return path
