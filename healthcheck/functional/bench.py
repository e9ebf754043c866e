"""The micro-benchmarks. Plain functions of a torch device, so they also run on the CPU in tests.

Each returns a :class:`Measurement`; timings bracket whole loops with a device synchronize,
which is accurate for loops of a few hundred milliseconds and keeps the code device-agnostic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from healthcheck.functional.measurement import Measurement


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_loop(device: torch.device, fn: Callable[[], Any], iters: int) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return time.perf_counter() - start


def _warm_up(device: torch.device, fn: Callable[[], Any], seconds: float, min_iters: int = 2) -> float:
    """Run ``fn`` for about ``seconds`` (clocks ramp up); return the seconds one call takes."""
    done, start = 0, time.perf_counter()
    batch = 1
    while True:
        _timed_loop(device, fn, batch)
        done += batch
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and done >= min_iters:
            return elapsed / done
        batch = min(batch * 2, 64)


def gemm(
    device: torch.device,
    n: int = 8192,
    warmup_s: float = 1.0,
    measure_s: float = 1.0,
    repeats: int = 3,
    dtype: torch.dtype = torch.bfloat16,
    check_rows: int = 4,
    sample: Callable[[], dict[str, Any]] | None = None,
) -> Measurement:
    """Dense GEMM throughput (``n`` x ``n`` x ``n``) on random data, with a correctness check.

    Correctness: a few rows of the product are recomputed on the CPU in float64 from the
    same inputs; the device's result must agree within bf16 rounding. The first and the last
    product of the timed loops must also be bitwise equal (the same kernel on the same data).
    ``sample`` is called while the loop runs (to read clocks under load).
    """
    gen = torch.Generator(device="cpu").manual_seed(1234)
    a = torch.randn(n, n, generator=gen, dtype=torch.float32).to(dtype).to(device)
    b = torch.randn(n, n, generator=gen, dtype=torch.float32).to(dtype).to(device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    first = torch.matmul(a, b)

    def step() -> None:
        torch.matmul(a, b, out=out)

    per_call = _warm_up(device, step, warmup_s)
    iters = max(1, int(measure_s / repeats / per_call))
    rates = []
    sampled: dict[str, Any] = {}
    for i in range(repeats):
        if sample is not None and i == repeats // 2:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(iters):
                step()
            sampled = sample()  # kernels are still queued: the device is busy
            synchronize(device)
            elapsed = time.perf_counter() - start
        else:
            elapsed = _timed_loop(device, step, iters)
        rates.append(2 * n**3 * iters / elapsed / 1e12)
    rates.sort()
    value = rates[len(rates) // 2]
    # Correctness.
    rows = torch.linspace(0, n - 1, check_rows).long().to(device)
    a_rows, b_all = a[rows].cpu().double(), b.cpu().double()
    reference = a_rows @ b_all
    got = first[rows].cpu().double()
    scale = (a_rows.abs() @ b_all.abs()).clamp_min(1e-6)
    del b_all
    rel_err = float(((got - reference).abs() / scale).max())
    stable = bool(torch.equal(first, out))
    # bf16 keeps 8 bits of mantissa: the rounding of the output alone is up to 2^-8 relative.
    tolerance = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    ok = rel_err <= tolerance and stable
    reason = (
        ""
        if ok
        else (
            f"wrong results: relative error {rel_err:.2e} > {tolerance:.0e}"
            if rel_err > tolerance
            else "results differ between runs of the same GEMM"
        )
    )
    details = {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "iterations": iters,
        "repeats": repeats,
        "all_tflops": [round(r, 1) for r in rates],
        "max_rel_error": rel_err,
        "bitwise_stable": stable,
    }
    details.update(sampled)
    return Measurement("gemm_bf16", "gemm_bf16_tflops", value, "TFLOP/s", ok, reason, details)


def memory_bandwidth(
    device: torch.device, size_bytes: int = 2 * 1024**3, warmup_s: float = 0.2, iters: int = 50
) -> Measurement:
    """Device-memory copy bandwidth: bytes read plus bytes written per second."""
    n = size_bytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)

    _warm_up(device, step, warmup_s)
    elapsed = _timed_loop(device, step, iters)
    value = 2 * n * 4 * iters / elapsed / 1e9
    ok = bool(dst[-1].item() == 1.0 and dst[0].item() == 1.0)
    return Measurement(
        "memory_bandwidth",
        "memory_bandwidth_gbps",
        value,
        "GB/s",
        ok,
        "" if ok else "copied data does not match",
        {"bytes": n * 4, "iterations": iters},
    )


def host_transfer(
    device: torch.device,
    size_bytes: int = 512 * 1024**2,
    iters: int = 10,
    sample: Callable[[], dict[str, Any]] | None = None,
) -> list[Measurement]:
    """Pinned host-to-device and device-to-host bandwidth (``sample`` is called during H2D)."""
    n = size_bytes // 4
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=torch.float32, pin_memory=pin)
    host.fill_(3.0)
    dev = torch.empty(n, dtype=torch.float32, device=device)
    results = []
    for direction in ("h2d", "d2h"):

        def step(direction: str = direction) -> None:
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)

        step()
        synchronize(device)
        sampled: dict[str, Any] = {}
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            step()
        if direction == "h2d" and sample is not None:
            sampled = sample()
        synchronize(device)
        elapsed = time.perf_counter() - start
        value = n * 4 * iters / elapsed / 1e9
        ok = bool(host[n // 2].item() == 3.0)
        details = {"bytes": n * 4, "iterations": iters, "pinned": pin, **sampled}
        results.append(
            Measurement(
                f"{direction}_bandwidth",
                f"{direction}_bandwidth_gbps",
                value,
                "GB/s",
                ok,
                "" if ok else "transferred data does not match",
                details,
            )
        )
    return results


PATTERNS = (0, -1, 0x5555555555555555, -0x5555555555555556)  # all 0s, all 1s, 0101..., 1010...


def memory_pattern(
    device: torch.device,
    fraction: float = 0.5,
    chunk_bytes: int = 1024**3,
    free_bytes: int | None = None,
    address_pattern: bool = True,
) -> Measurement:
    """Allocate ``fraction`` of free device memory, write patterns, read them back.

    Constant patterns check every bit both ways; an address-derived pattern (each 8-byte
    word holds a function of its index), written everywhere before any is read back, catches
    addressing faults where two locations alias.
    """
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 256 * 1024**2
    total = int(free_bytes * fraction) // chunk_bytes * chunk_bytes
    if total == 0:
        total = chunk_bytes
    words = chunk_bytes // 8
    chunks = [torch.empty(words, dtype=torch.int64, device=device) for _ in range(total // chunk_bytes)]
    mismatches = 0
    start = time.perf_counter()
    for pattern in PATTERNS:
        for c in chunks:
            c.fill_(pattern)
        for c in chunks:
            mismatches += int((c != pattern).sum())
    if address_pattern:
        k = 0x9E3779B97F4A7C1  # odd multiplier: distinct words get distinct values

        def expected(i: int) -> torch.Tensor:
            return torch.arange(i * words, (i + 1) * words, dtype=torch.int64, device=device).mul_(k)

        for i, c in enumerate(chunks):
            c.copy_(expected(i))
        for i, c in enumerate(chunks):
            mismatches += int((c != expected(i)).sum())
    synchronize(device)
    elapsed = time.perf_counter() - start
    tested = len(chunks) * chunk_bytes
    del chunks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    patterns = len(PATTERNS) + (1 if address_pattern else 0)
    reason = "" if mismatches == 0 else f"{mismatches} words read back wrong"
    return Measurement(
        "memory_pattern",
        None,
        float(mismatches),
        "words",
        mismatches == 0,
        reason,
        {"tested_bytes": tested, "patterns": patterns, "seconds": round(elapsed, 3), "free_bytes": free_bytes},
    )
