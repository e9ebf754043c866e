"""The host's own functional figures: CPU matrix throughput and host memory bandwidth.

Run in a functional-check worker on the CPU device (``healthcheck.functional.worker``), at the
``standard`` and ``full`` levels, on every node (with or without accelerators): a node whose
CPU is throttled, shared or pinned to fewer cores than its peers shows here, and a CPU-only
node has figures the job-wide peer comparison can use. Each takes well under a second.

Both run on one thread by default: one core's throughput, which is stable from run to run and
from node to node (a multi-threaded BLAS on a busy machine mostly measures its threads waiting
for each other); a node whose cores are throttled, slower or oversubscribed shows. The figure is
the best of a few short runs (the least disturbed one): a node slow in every run is slow, a
node that another process interrupted once is not. Both carry
``peer_group`` (the CPU model) in their details: nodes are compared with nodes of the same CPU
only.
"""

from __future__ import annotations

import os
import time

import torch

from healthcheck.functional.measurement import Measurement

MAX_MODEL_CHARS = 120


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()[:MAX_MODEL_CHARS]
    except OSError:
        pass
    return (os.uname().machine or "unknown")[:MAX_MODEL_CHARS]


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _details(**extra: object) -> dict[str, object]:
    model = cpu_model()
    return {
        "peer_group": f"cpu {model}",
        "cpu_model": model,
        "cpus": _cpus(),
        "threads": torch.get_num_threads(),
        **extra,
    }


def host_gemm(
    n: int = 1024, measure_s: float = 0.4, repeats: int = 5, warmup_s: float = 0.1, threads: int = 1
) -> Measurement:
    """float32 ``n`` x ``n`` x ``n`` matrix products on the CPU (torch's own BLAS on ``threads``
    threads), GFLOP/s of the best of ``repeats`` timed runs; a few rows are recomputed in
    float64 (relative error <= 1e-4)."""
    torch.set_num_threads(max(1, threads))
    gen = torch.Generator(device="cpu").manual_seed(4321)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32)
    out = torch.empty(n, n, dtype=torch.float32)
    torch.matmul(a, b, out=out)
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < warmup_s or calls < 1:
        torch.matmul(a, b, out=out)
        calls += 1
    per_call = max((time.perf_counter() - start) / calls, 1e-6)
    iters = max(1, int(measure_s / repeats / per_call))
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        rates.append(2 * n**3 * iters / max(time.perf_counter() - t0, 1e-9) / 1e9)
    rates.sort()
    rows = torch.linspace(0, n - 1, 4).long()
    a_rows, b_all = a[rows].double(), b.double()
    reference = a_rows @ b_all
    scale = (a_rows.abs() @ b_all.abs()).clamp_min(1e-6)
    rel_err = float(((out[rows].double() - reference).abs() / scale).max())
    ok = rel_err <= 1e-4
    return Measurement(
        "host_gemm_fp32",
        "host_gemm_fp32_gflops",
        rates[-1],
        "GFLOP/s",
        ok,
        "" if ok else f"wrong results: relative error {rel_err:.2e} > 1e-04",
        _details(
            n=n, iterations=iters, repeats=repeats, all_gflops=[round(r, 1) for r in rates], max_rel_error=rel_err
        ),
    )


def host_memory_bandwidth(
    size_bytes: int = 128 * 1024**2, iters: int = 2, repeats: int = 5, threads: int = 1
) -> Measurement:
    """Host memory copy bandwidth (bytes read plus bytes written per second, on ``threads``
    threads) of a buffer well beyond the caches, the best of ``repeats`` timed runs of ``iters``
    copies."""
    torch.set_num_threads(max(1, threads))
    n = max(1, size_bytes // 4)
    src = torch.empty(n, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the pages are touched before any timing
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        rates.append(2 * n * 4 * iters / max(time.perf_counter() - t0, 1e-9) / 1e9)
    rates.sort()
    ok = bool(dst[0].item() == 1.0 and dst[-1].item() == 1.0)
    return Measurement(
        "host_memory_bandwidth",
        "host_memory_bandwidth_gbps",
        rates[-1],
        "GB/s",
        ok,
        "" if ok else "copied data does not match",
        _details(bytes=n * 4, iterations=iters, repeats=repeats),
    )
