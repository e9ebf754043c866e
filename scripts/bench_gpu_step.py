#!/usr/bin/env python3
"""Benchmark the GPU step marker: what the CUDA event at each step boundary costs a step.

A small training loop (launch-bound on a GPU: its host side is the step time, the worst case
for a per-step host cost) runs in this process with dynprof's optimizer step hook installed.
Blocks of steps alternate between the marker on and off (the rest of the hook runs in both),
so both are measured side by side under the same machine noise (the marker records at most
once per 10 ms, so on short steps most steps only check the clock); the figure is the paired
ratio, step time with the marker / without (this thread's CPU time on the CPU, wall time on
CUDA). Each block ends with one synchronize of the
benchmark's own (so a block's wall time includes its GPU work); dynprof never synchronizes.
The marker's call is also timed alone.

On CUDA it measures the event record path (``--device cuda``, the default where CUDA is
there); on the CPU it measures the hook's no-CUDA path (one ``torch.cuda.is_initialized()``).

    python scripts/bench_gpu_step.py [--device cpu|cuda] [--rounds 40] [--block 100] [--width 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(device: str, rounds: int, block: int, width: int) -> dict[str, Any]:
    import torch

    from dynprof.agent._steps import _TORCH, StepTracker

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dev = torch.device(device)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    tracker = StepTracker()
    tracker.install()
    assert tracker.hook_installed, "the optimizer step hook should be installed (torch.optim is imported)"
    marker = tracker.gpu
    # On the CPU, this thread's CPU time (immune to being descheduled on a shared machine); on
    # CUDA, wall time (a block's GPU work is waited for at its end).
    clock = time.perf_counter if dev.type == "cuda" else time.thread_time
    for _ in range(200):
        step()
    sync()
    with_marker: list[float] = []
    without: list[float] = []
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for on in order:
            marker.enabled = on
            t0 = clock()
            for _ in range(block):
                step()
            sync()
            dt = (clock() - t0) / block
            (with_marker if on else without).append(dt)
    marker.enabled = True
    look = marker.look(torch)
    n = 20_000

    def record() -> None:  # the record itself: the gap check passes every time
        marker._last_record = float("-inf")
        marker.mark(_TORCH[0], opt, 1)

    mark_s = timeit.timeit(record, number=n) / n
    sync()
    skip_s = timeit.timeit(lambda: marker.mark(_TORCH[0], opt, 1), number=n) / n  # within the gap
    call_s = timeit.timeit(lambda: None, number=n) / n
    look_s = timeit.timeit(lambda: marker.look(torch), number=2_000) / 2_000
    tracker.uninstall()
    ratios = [a / b for a, b in zip(with_marker, without)]
    return {
        "device": device,
        "clock": "wall" if dev.type == "cuda" else "thread CPU",
        "cuda_initialized": bool(torch.cuda.is_initialized()),
        "event_recorded": look.recorded,
        "marker_on": marker.enabled,
        "width": width,
        "rounds": rounds,
        "block": block,
        "step_ms_without": statistics.median(without) * 1e3,
        "step_ms_with": statistics.median(with_marker) * 1e3,
        "mean_paired_ratio": statistics.fmean(ratios),
        "sem": statistics.stdev(ratios) / len(ratios) ** 0.5,
        "median_paired_ratio": statistics.median(ratios),
        "paired_ratio_p25": statistics.quantiles(ratios, n=4)[0],
        "paired_ratio_p75": statistics.quantiles(ratios, n=4)[2],
        "mark_us": (mark_s - call_s) * 1e6,
        "skip_us": (skip_s - call_s) * 1e6,
        # what a step pays on average at this step time: one record per MIN_GAP_S at most
        "amortised_us": _amortised(mark_s - call_s, skip_s - call_s, statistics.median(without)) * 1e6,
        "mark_fraction_of_step": _amortised(mark_s - call_s, skip_s - call_s, statistics.median(without))
        / statistics.median(without),
        "status_look_us": look_s * 1e6,
    }


def _amortised(record_s: float, skip_s: float, step_s: float) -> float:
    from dynprof.agent._gpu_step import MIN_GAP_S

    recorded = min(1.0, step_s / MIN_GAP_S)  # the share of steps that record
    return recorded * record_s + (1.0 - recorded) * skip_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where it is there")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_step: --device cuda, but CUDA is not available here", file=sys.stderr)
        return 2
    r = run(device, args.rounds, args.block, args.width)
    if args.json:
        print(json.dumps(r))
        return 0
    path = "CUDA event record" if r["event_recorded"] else "no CUDA (torch.cuda.is_initialized() only)"
    print(f"== GPU step marker, step-time cost on {device}: {path} ==")
    print(f"loop: MLP width {r['width']}, {r['rounds']} rounds x 2 blocks x {r['block']} steps, alternating")
    print(f"median step without marker ({r['clock']} time): {r['step_ms_without']:.4f} ms")
    print(f"median step with marker ({r['clock']} time):    {r['step_ms_with']:.4f} ms")
    print(
        f"median paired ratio:        {r['median_paired_ratio']:.4f}"
        f"  (IQR {r['paired_ratio_p25']:.4f} .. {r['paired_ratio_p75']:.4f})"
    )
    print(f"mean paired ratio:          {r['mean_paired_ratio']:.4f} +/- {r['sem']:.4f} (standard error)")
    print(f"one record, timed alone: {r['mark_us']:.3f} us; a step within the 10 ms gap: {r['skip_us']:.3f} us")
    print(
        f"marker per step at this step time (one record per 10 ms at most): {r['amortised_us']:.3f} us"
        f" = {100 * r['mark_fraction_of_step']:.4f} % of a step"
    )
    print(f"status look (event.query), timed alone: {r['status_look_us']:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
