"""A distributed job that hangs on purpose, for ``dynprof stacks`` / ``dynprof nccl`` tests.

Every rank trains a few steps (with an all_reduce of the gradients each step), then:
rank 0 enters one more all_reduce and waits in it; the other ranks are held elsewhere first:
``--hold sleep`` sleeps in ``wait_for_data`` (Python, GIL released), ``--hold gil`` spins in a
C call holding the GIL (``spin_holding_gil``), ``--hold skip`` skips the collective and sleeps.
Prints ``READY <pid>`` once the rank is where it is meant to stay. ``--backend nccl`` uses one
GPU per rank (LOCAL_RANK) and synchronises after the collective, as a training step would.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist


def wait_for_data(seconds: float) -> None:
    print(f"READY {os.getpid()}", flush=True)
    time.sleep(seconds)


def spin_holding_gil(seconds: int) -> None:
    # PyDLL calls keep the GIL: the interpreter is stuck in C code and runs no Python.
    libc = ctypes.PyDLL("libc.so.6")
    print(f"READY {os.getpid()}", flush=True)
    libc.sleep(seconds)


def collective_wait(t: torch.Tensor, device: torch.device) -> None:
    print(f"READY {os.getpid()}", flush=True)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", choices=("sleep", "gil", "skip"), default="sleep")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()

    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    model = torch.nn.Linear(16, 16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16, device=device)
    for _ in range(args.steps):
        opt.zero_grad()
        model(x).sum().backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t = torch.ones(1024, device=device)
    if rank == 0:
        collective_wait(t, device)
    elif args.hold == "gil":
        spin_holding_gil(int(args.seconds))
    else:
        wait_for_data(args.seconds)
        if args.hold == "sleep":
            dist.all_reduce(t)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
