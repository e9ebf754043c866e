"""A training loop that replaces its optimizer mid-run (SGD for AdamW), as a job's second phase does.

Prints ``READY <pid>`` after the first optimizer step. With ``--wait-trace`` it waits after its
fifth step until a dynprof trace of it is requested (armed, for a later step, or running). At step ``--replace-at`` the
SGD optimizer is replaced by a new AdamW (the old one dropped, or kept alive with
``--keep-old``). After ``--replace-at + 10`` steps it prints ``PAUSED <steps>`` and sleeps.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _trace_loop import after_step, mse_step, trace_state


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replace-at", type=int, default=30)
    parser.add_argument("--keep-old", action="store_true")
    parser.add_argument("--wait-trace", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    step = 0
    while step < args.replace_at + 10:
        if step + 1 == args.replace_at:
            if args.keep_old:
                kept.append(opt)
            opt = torch.optim.AdamW(model.parameters(), lr=0.001)  # the SGD one is dropped here
        mse_step(model, opt, x, y)
        step += 1
        after_step(step)
        if args.wait_trace and step == 5:
            deadline = time.monotonic() + 60
            while trace_state() == "idle" and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(0.01)
    print(f"PAUSED {step}", flush=True)
    time.sleep(300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
