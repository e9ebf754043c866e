"""One rank's trace reduced to its figures (collectors/trace_analysis/rank.py), on synthetic
traces whose timelines are known to the microsecond, and every rank's in parallel."""

from __future__ import annotations

import gzip
import os

import pytest

from collectors.trace_analysis.rank import (
    RankInput,
    analyze_rank,
    analyze_ranks,
    default_workers,
    device_of,
    is_comm_kernel,
    is_comm_op,
    profiler_step_number,
)
from collectors.trace_analysis.reader import TraceError
from tests.unit._trace_analysis_cases import gpu_trace, write_events


def test_gpu_breakdown_is_exact_on_a_known_timeline(tmp_path):
    # GIVEN a synthetic GPU trace whose step timeline is known to the microsecond
    path = gpu_trace(tmp_path / "r0.json.gz", rank=0)

    # WHEN it is analysed
    (r,) = [analyze_rank(RankInput(str(path)))]

    # THEN the GPU categories are the known intervals and add up to the 10 ms step
    g = r["steps"][0]["gpu"]
    assert g["compute"] == pytest.approx(3.5)  # 1-4 ms and the second stream's 9-9.5 ms
    assert g["comm_overlap"] == pytest.approx(1.0)  # 4-5 ms
    assert g["comm"] == pytest.approx(2.0)  # 5-7 ms
    assert g["memcpy"] == pytest.approx(1.0)  # 7-8 ms (6.5-7 is under the NCCL kernel)
    assert g["idle"] == pytest.approx(2.5)
    assert sum(g.values()) == pytest.approx(r["steps"][0]["step_ms"]) == pytest.approx(10.0)
    assert r["steps"][0]["cpu"]["collective"] == pytest.approx(0.05)
    assert [s["step"] for s in r["steps"]] == [5, 6, 7]  # the GPU copies of ProfilerStep are not steps
    assert r["kernels"]["ncclDevKernel_AllReduce_Sum_f32_RING_LL"][0] == 3


@pytest.mark.parametrize("uuid", ["", "x" * 101, "GPU-\n1", 7, None])
def test_a_manifest_gpu_device_is_taken_only_when_it_is_a_short_printable_uuid(uuid):
    assert device_of({"gpu_device": {"index": 0, "uuid": uuid}}) is None
    assert device_of({"gpu_device": "GPU-1"}) is None and device_of([]) is None
    assert device_of({"gpu_device": {"index": 0, "uuid": "GPU-ab-12"}}) == "GPU-ab-12"


def test_backward_on_an_autograd_device_thread_counts_as_operators(tmp_path):
    # GIVEN a step (synthetic) whose backward runs on the autograd engine's device thread for
    # 4 ms while the training thread waits, and a data-loader thread busy in an operator
    def x(name: str, tid: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 7, "tid": 7, "ts": 0, "dur": 10_000},
        x("aten::linear", 7, 1000, 1000),
        x("autograd::engine::evaluate_function: AddmmBackward0", 9, 2000, 4000),
        x("aten::pin_memory", 11, 0, 10_000),
    ]
    path = write_events(tmp_path / "t.json.gz", events)

    # WHEN it is analysed
    cpu = analyze_rank(RankInput(str(path)))["steps"][0]["cpu"]

    # THEN forward and backward are operator time; the data-loader thread hides nothing
    assert cpu["ops"] == pytest.approx(5.0)
    assert cpu["outside_ops"] == pytest.approx(5.0)


def test_fewer_workers_when_traces_are_large(monkeypatch, tmp_path):
    # GIVEN 8 traces whose gzip trailers say 1 GiB each, and 3 GiB of memory available
    import psutil

    for i in range(8):
        (tmp_path / f"r{i}.json.gz").write_bytes(gzip.compress(b"{}")[:-4] + (1024**3).to_bytes(4, "little"))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 3 * 1024**3})())
    monkeypatch.setattr(os, "cpu_count", lambda: 64)

    # WHEN the number of parallel workers is chosen
    n = default_workers([RankInput(str(p)) for p in tmp_path.glob("*.gz")])

    # THEN it keeps them under half the available memory
    assert n == 1


@pytest.mark.parametrize(
    "name", ["ProfilerStep#-1", "ProfilerStep#\u0661\u0662", "ProfilerStep# 3", "ProfilerStep#1_0"]
)
def test_a_step_number_is_read_only_in_ascii_digits_and_never_negative(tmp_path, name):
    # GIVEN a trace whose steps are #5, #6 and one span named otherwise (-1, Arabic-Indic 12, ...)
    events = [
        {"ph": "X", "cat": "user_annotation", "name": n, "pid": 7, "tid": 7, "ts": 1e6 + i * 1e4, "dur": 1e4}
        for i, n in enumerate(["ProfilerStep#5", "ProfilerStep#6", name])
    ]
    path = write_events(tmp_path / "r0.json.gz", events, schemaVersion=1)
    # WHEN it is analysed
    r = analyze_rank(RankInput(str(path)))
    # THEN that span is not a step: no step -1 or 12
    assert [s["step"] for s in r["steps"]] == [5, 6]
    assert profiler_step_number(name) is None and profiler_step_number("ProfilerStep#12") == 12


@pytest.mark.parametrize(
    "name, comm",
    [
        ("c10d::allreduce_", True),
        ("record_param_comms", True),
        ("gloo:all_reduce", True),
        ("_c10d_functional::wait_tensor", True),
        ("nccl:all_gather", True),
        ("aten::mm", False),
        ("my_c10d::allreduce", False),  # a collective's prefix, not at the start
    ],
)
def test_a_collective_operator_is_known_by_its_prefix(name, comm):
    assert is_comm_op(name) is comm


@pytest.mark.parametrize(
    "name, comm",
    [
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", True),
        ("rccl_kernel", True),
        ("cross_device_reduce_1stage", True),
        ("void all_gather_kernel<float>", True),
        ("ampere_sgemm_128x64_tn", False),
        ("elementwise_kernel", False),
    ],
)
def test_a_communication_kernel_is_known_by_a_word_in_its_name(name, comm):
    assert is_comm_kernel(name) is comm


def test_a_trace_without_profiler_steps_is_a_trace_error(tmp_path):
    path = write_events(tmp_path / "r0.json.gz", [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
    with pytest.raises(TraceError, match="no ProfilerStep spans"):
        analyze_rank(RankInput(str(path)))


def test_the_rank_and_host_given_are_taken_over_what_the_trace_says(tmp_path):
    # GIVEN a trace that says it is rank 0 of 2, on nccl
    path = gpu_trace(tmp_path / "r0.json.gz", rank=0)
    said = analyze_rank(RankInput(str(path)))
    assert (said["rank"], said["world_size"], said["backend"], said["has_gpu"]) == (0, 2, "nccl", True)

    # WHEN it is analysed as rank 3 of host "b", artifact "x", on a GPU
    r = analyze_rank(RankInput(str(path), rank=3, host="b", artifact="x", device="GPU-1"))

    # THEN those are what the figures carry
    assert (r["rank"], r["host"], r["artifact"], r["device"]) == (3, "b", "x", "GPU-1")


def test_events_with_absurd_times_are_left_out(tmp_path):
    # GIVEN a step with one real operator and operators whose times no trace can hold
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 7, "tid": 7, "ts": 0, "dur": 10_000}

    def op(ts: object, dur: object) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 7, "ts": ts, "dur": dur}

    events = [step, op(1000, 2000), op(0, 1e12), op(1e300, 5), op(0, -1), op("x", 5), op(0, 10**400)]
    path = write_events(tmp_path / "r0.json.gz", events)

    # WHEN it is analysed THEN only the real operator counts
    r = analyze_rank(RankInput(str(path)))
    assert r["steps"][0]["cpu"]["ops"] == pytest.approx(2.0)
    assert r["ops"]["aten::mm"][0] == 1


def test_every_rank_is_analysed_and_a_trace_that_cannot_be_is_an_error_row(tmp_path):
    # GIVEN one good trace and one damaged
    good = gpu_trace(tmp_path / "r0.json.gz", rank=0)
    bad = tmp_path / "r1.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"'))

    # WHEN both are analysed
    rows = analyze_ranks([RankInput(str(good)), RankInput(str(bad), rank=1)], workers=1)

    # THEN the good one has its figures, in order, and the damaged one says what is wrong
    assert rows[0]["rank"] == 0 and "error" not in rows[0]
    assert rows[1]["rank"] == 1 and rows[1]["path"] == str(bad) and "truncated" in rows[1]["error"]
