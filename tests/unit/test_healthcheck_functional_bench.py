"""healthcheck.functional.bench: the micro-benchmarks on the CPU device with tiny sizes; what
each measures, and that a wrong or unstable GEMM is reported as such."""

from __future__ import annotations

import pytest
import torch

from healthcheck.functional import bench

CPU = torch.device("cpu")


def test_synchronize_on_the_cpu_does_nothing_and_needs_no_cuda():
    bench.synchronize(CPU)  # must not touch torch.cuda on a machine without it
    assert not torch.cuda.is_initialized()


def test_gemm_measures_a_correct_and_stable_product():
    m = bench.gemm(CPU, n=64, warmup_s=0.005, measure_s=0.01, repeats=3, dtype=torch.float32)
    assert m.ok is True and m.reason == ""
    assert (m.check, m.metric, m.unit) == ("gemm_bf16", "gemm_bf16_tflops", "TFLOP/s")
    assert m.value > 0
    assert m.details["bitwise_stable"] is True
    assert m.details["max_rel_error"] <= 1e-4
    assert (m.details["n"], m.details["dtype"], m.details["repeats"]) == (64, "float32", 3)
    # the value is the median of the repeats
    assert len(m.details["all_tflops"]) == 3


def test_gemm_calls_the_sampler_once_and_keeps_what_it_read():
    calls = []

    def sample():
        calls.append(1)
        return {"sm_clock_mhz": 1980}

    m = bench.gemm(CPU, n=32, warmup_s=0.0, measure_s=0.005, repeats=3, dtype=torch.float32, sample=sample)
    assert calls == [1]
    assert m.details["sm_clock_mhz"] == 1980


def test_a_gemm_with_wrong_results_is_not_ok_and_says_by_how_much(monkeypatch):
    # GIVEN a matmul whose first product (the one checked against float64) is off by 10 %
    real = torch.matmul

    def wrong(a, b, out=None):
        if out is None:
            return real(a, b) * 1.1
        return real(a, b, out=out)

    monkeypatch.setattr(bench.torch, "matmul", wrong)
    m = bench.gemm(CPU, n=32, warmup_s=0.0, measure_s=0.005, repeats=1, dtype=torch.float32)
    assert m.ok is False
    assert m.reason.startswith("wrong results: relative error")


def test_a_gemm_whose_runs_differ_is_not_ok(monkeypatch):
    # GIVEN a matmul exact the first time, and a hair different in the timed loop
    real = torch.matmul

    def drifting(a, b, out=None):
        if out is None:
            return real(a, b)
        real(a, b, out=out)
        return out.add_(1e-3)

    monkeypatch.setattr(bench.torch, "matmul", drifting)
    m = bench.gemm(CPU, n=32, warmup_s=0.0, measure_s=0.005, repeats=1, dtype=torch.float32)
    assert m.ok is False
    assert m.reason == "results differ between runs of the same GEMM"
    assert m.details["bitwise_stable"] is False


def test_memory_bandwidth_counts_bytes_read_and_written():
    m = bench.memory_bandwidth(CPU, size_bytes=1024**2 + 3, warmup_s=0.0, iters=3)
    assert m.ok is True
    assert (m.metric, m.unit) == ("memory_bandwidth_gbps", "GB/s")
    assert m.details == {"bytes": 1024**2, "iterations": 3}
    assert m.value > 0


def test_host_transfer_measures_both_directions_and_samples_only_the_first():
    sampled = []
    got = bench.host_transfer(CPU, size_bytes=64 * 1024, iters=2, sample=lambda: sampled.append(1) or {"gen": 5})
    assert [m.check for m in got] == ["h2d_bandwidth", "d2h_bandwidth"]
    assert all(m.ok for m in got)
    assert got[0].details["gen"] == 5 and "gen" not in got[1].details
    assert got[0].details["pinned"] is False, "only CUDA memory is pinned"
    assert sampled == [1]


def test_memory_pattern_tests_the_fraction_of_free_memory_in_whole_chunks():
    # GIVEN 1 MiB "free" and 64 KiB chunks, half of it tested
    m = bench.memory_pattern(CPU, fraction=0.5, chunk_bytes=64 * 1024, free_bytes=1024**2)
    # THEN 8 chunks are tested with every pattern and no word is wrong
    assert m.ok is True and m.value == 0.0 and m.metric is None
    assert m.details["tested_bytes"] == 512 * 1024
    assert m.details["patterns"] == len(bench.PATTERNS) + 1


def test_memory_pattern_tests_at_least_one_chunk():
    m = bench.memory_pattern(CPU, fraction=0.5, chunk_bytes=64 * 1024, free_bytes=1000, address_pattern=False)
    assert m.details["tested_bytes"] == 64 * 1024
    assert m.details["patterns"] == len(bench.PATTERNS)


def test_the_constant_patterns_set_every_bit_both_ways():
    # all 0s, all 1s, 0101... and 1010...: each bit is 0 in one pattern and 1 in another
    words = [p & 0xFFFFFFFFFFFFFFFF for p in bench.PATTERNS]
    assert words == [0, 0xFFFFFFFFFFFFFFFF, 0x5555555555555555, 0xAAAAAAAAAAAAAAAA]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gemm_is_judged_within_its_rounding(dtype):
    m = bench.gemm(CPU, n=32, warmup_s=0.0, measure_s=0.005, repeats=1, dtype=dtype)
    assert m.ok is True, m.reason
    assert m.details["max_rel_error"] <= 1e-2
