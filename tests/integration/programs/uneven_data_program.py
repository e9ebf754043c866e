"""A 2-rank gloo job whose ranks have uneven data: rank --short-rank runs out of batches one
step early and waits in the barrier after its loop, while the other rank waits in the next
step's all_reduce of the gradients, inside the loop. Prints ``READY <pid>`` after the first
optimizer step and ``END <pid>`` when its loop is done (the short rank only)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
    opt.step()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short-rank", type=int, default=0)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = args.batches if rank == args.short_rank else args.batches + 1
    for step in range(batches):
        train_step(model, opt, torch.randn(8, 16))
        if step == 0:
            print(f"READY {os.getpid()}", flush=True)
    print(f"END {os.getpid()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
