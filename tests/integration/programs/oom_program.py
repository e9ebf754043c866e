"""A training loop whose batch grows until CUDA runs out of memory.

First --warmup-steps ordinary steps at a small batch (they fill the allocator's history with
everyday training events), then every step the batch grows by --grow-mb of input and the step's
inputs are kept "for later" (a classic leak), until an allocation fails. Prints::

    READY <pid>          once the first optimizer step is done
    ALLOC <bytes>        before each input allocation of the growing phase
    OOM <bytes>          when OutOfMemoryError reaches the loop (then re-raised, unless --retries)

With --retries N it catches the OOM and tries the same allocation N more times (a retry loop,
as some jobs have), then exits 0. With --limit-gb it caps this process's share of the device
(torch.cuda.set_per_process_memory_fraction) so the OOM comes quickly and small.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def make_inputs(rows: int, width: int, device: torch.device) -> torch.Tensor:
    print(f"ALLOC {rows * width * 4}", flush=True)
    return torch.randn(rows, width, device=device)  # the growing allocation


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--grow-mb", type=int, default=512)
    parser.add_argument("--retries", type=int, default=0)
    parser.add_argument("--limit-gb", type=float, default=0.0)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.limit_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gb * 2**30 / total), device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step(x: torch.Tensor) -> None:
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    small = torch.randn(64, args.width, device=device)
    for step in range(max(args.warmup_steps, 1)):
        train_step(small)
        if step == 0:
            print(f"READY {os.getpid()}", flush=True)
    torch.cuda.synchronize(device)

    rows_per_step = max(1, args.grow_mb * 2**20 // (args.width * 4))
    kept: list[torch.Tensor] = []
    rows = 0
    while True:
        rows += rows_per_step
        try:
            x = make_inputs(rows, args.width, device)
        except torch.cuda.OutOfMemoryError:
            print(f"OOM {rows * args.width * 4}", flush=True)
            if args.retries <= 0:
                raise
            for _ in range(args.retries):
                try:
                    make_inputs(rows, args.width, device)
                except torch.cuda.OutOfMemoryError:
                    print(f"OOM {rows * args.width * 4}", flush=True)
            print("DONE", flush=True)
            return 0
        train_step(x[:64])
        kept.append(x)


if __name__ == "__main__":
    sys.exit(main())
