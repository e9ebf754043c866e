"""A training loop with a long evaluation marked with ``dynprof.phase`` and, after it, an
unmarked stall: for the hang watchdog's tests.

Steps for --steps steps, prints ``EVAL <pid>`` and evaluates (no optimizer step) for
--eval-seconds inside ``with dynprof.phase("eval")``, steps again, then prints ``STALL <pid>``
and stops stepping (sleeps) until --seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import dynprof


def evaluate(model: torch.nn.Module, x: torch.Tensor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < deadline:
            model(x)
            time.sleep(0.01)


def stall_unmarked(seconds: float) -> None:
    time.sleep(seconds)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-seconds", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    start = time.monotonic()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)

    def train(steps: int) -> None:
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.01)

    train(args.steps)
    os.write(1, f"EVAL {os.getpid()}\n".encode())
    with dynprof.phase("eval"):
        evaluate(model, x, args.eval_seconds)
    train(args.steps)
    os.write(1, f"STALL {os.getpid()}\n".encode())
    stall_unmarked(max(0.0, args.seconds - (time.monotonic() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
