"""A gloo job whose rank ``--cuda-rank`` trains on the GPU and, after ``--steps`` steps, stops in a
CUDA wait: it launches a kernel that spins for minutes and calls ``torch.cuda.synchronize``, as
a rank behind a stuck kernel would. The other ranks train on the CPU and wait for it in the
next step's all_reduce. Each rank prints ``READY <pid>`` once it is where it stays."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def reduce_gradients(model: torch.nn.Module) -> None:
    for p in model.parameters():
        assert p.grad is not None
        g = p.grad.detach().cpu()
        dist.all_reduce(g)
        p.grad.copy_(g.to(p.grad.device))


def wait_for_kernel(device: torch.device) -> None:
    # torch.cuda._sleep spins the GPU for a number of cycles: ~10 minutes on any GPU of today
    torch.cuda._sleep(int(2e12))
    print(f"READY {os.getpid()}", flush=True)
    torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda-rank", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if rank == args.cuda_rank else torch.device("cpu")
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, device=device)
    step = 0
    while True:
        opt.zero_grad()
        model(x).sum().backward()
        if step == args.steps:
            if rank == args.cuda_rank:
                wait_for_kernel(device)
            else:
                print(f"READY {os.getpid()}", flush=True)
        reduce_gradients(model)
        opt.step()
        step += 1
        if step > args.steps:  # only reached once the CUDA rank came back
            print("DONE", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
