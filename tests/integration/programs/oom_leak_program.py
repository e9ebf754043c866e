"""A training loop that leaks a little device memory every step until CUDA runs out of memory.

Workloads as in scripts/bench_memory_history.py: ``launch`` (tiny layers, launch-bound, ~1 000
allocator events a step) and ``gpu`` (wide layers, GPU-bound). It trains --warmup-seconds
normally, then every step keeps --leak-mb of device memory "for later" (``remember``: the leak
site an OOM report should name) until an allocation fails under the --limit-gb cap. Prints::

    READY <pid>     after the first optimizer step
    LEAKING         when the leak starts
    OOM <step>      when OutOfMemoryError reaches the loop; then exits 0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scripts.bench_memory_history import build

kept: list[torch.Tensor] = []


def remember(nbytes: int, device: torch.device) -> None:
    kept.append(torch.empty(nbytes, dtype=torch.uint8, device=device))  # the leak


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=("launch", "small", "gpu"), default="launch")
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--leak-mb", type=float, default=2.0)
    parser.add_argument("--limit-gb", type=float, default=2.0)
    args = parser.parse_args()

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gb * 2**30 / total), device)
    torch.manual_seed(0)
    model, opt, x = build(args.workload, device)

    def train_step() -> None:
        loss = model(x).float().pow(2).mean()  # type: ignore[operator]
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        loss.backward()
        opt.step()  # type: ignore[attr-defined]

    train_step()
    print(f"READY {os.getpid()}", flush=True)
    end = time.monotonic() + args.warmup_seconds
    while time.monotonic() < end:
        train_step()
    print("LEAKING", flush=True)
    step = 0
    try:
        while True:
            step += 1
            train_step()
            remember(int(args.leak_mb * 2**20), device)
    except torch.cuda.OutOfMemoryError:
        print(f"OOM {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
