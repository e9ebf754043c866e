"""Jobs launched the way many scripts do without torchrun, for target-selection tests.

--mode ranks: torch.multiprocessing.spawn starts 2 ranks that set RANK/WORLD_SIZE themselves
(after their interpreter, and the agent, started) and join a gloo group; the parent only waits.
Rank 0's store binds a port the system picks (port 0) and hands it to rank 1 through a queue: a
port picked first and bound later may be taken in between on a loaded machine (EADDRINUSE).
--mode single: this process trains by itself.
Either way a spawned helper process (like a DataLoader worker started with "spawn") sleeps
beside them and never steps an optimizer. Each training process prints ``READY <pid>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp


def train(rank: int | None, world: int, ports: Any, seconds: float) -> None:
    if rank is not None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        import torch.distributed as dist

        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            for _ in range(world - 1):
                ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(), world, is_master=False)
        os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    deadline = time.monotonic() + seconds
    ready = False
    while time.monotonic() < deadline:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if rank is not None:
            import torch.distributed as dist

            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())  # one write: ranks share the pipe
            ready = True
        time.sleep(0.005)


def sleeper(seconds: float) -> None:
    time.sleep(seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ranks", "single"], default="ranks")
    parser.add_argument("--seconds", type=float, default=90)
    args = parser.parse_args()
    helper = mp.get_context("spawn").Process(target=sleeper, args=(args.seconds,), daemon=True)
    helper.start()
    if args.mode == "single":
        train(None, 1, None, args.seconds)
        return 0
    ports = mp.get_context("spawn").SimpleQueue()
    mp.spawn(train, args=(2, ports, args.seconds), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
