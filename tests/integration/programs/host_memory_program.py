"""A CPU training loop that keeps host memory in CPU tensors, growing or steady.

Prints ``READY <pid> <rss bytes>`` once the first step is done and the baseline is allocated,
``GREW <rss bytes>`` after each growth and ``HELD <rss bytes>`` once it has reached
--target-mb above its baseline, then keeps stepping until --max-seconds.
Every chunk is one CPU tensor of --chunk-mb, filled (so its pages are resident), kept in
the list ``activation_cache``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target-mb", type=int, default=0, help="grow by this much over the baseline")
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between chunks")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    args = parser.parse_args()

    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    print(f"READY {os.getpid()} {rss()}", flush=True)
    activation_cache: list[torch.Tensor] = []
    grown = 0
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        step()
        if grown < args.target_mb:
            chunk = torch.ones(args.chunk_mb * 2**20 // 4, dtype=torch.float32)
            activation_cache.append(chunk)
            grown += args.chunk_mb
            print(f"GREW {rss()}", flush=True)
            if grown >= args.target_mb:
                print(f"HELD {rss()}", flush=True)
        time.sleep(args.interval)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
