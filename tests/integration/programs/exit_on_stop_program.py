"""A training loop that ends as soon as a dynprof trace of it starts exporting.

Prints ``READY <pid>`` after the first optimizer step. Once the agent's trace has been
stopped (its state turns to ``exporting``), the loop ends and the process exits normally
while the export may still be running: the agent finishes it at exit.
"""

from __future__ import annotations

import sys
import time

import torch
from _trace_loop import after_step, mse_step, trace_state


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        mse_step(model, opt, x, y)
        step += 1
        after_step(step)
        if trace_state() == "exporting":
            break
        time.sleep(0.005)
    print(f"DONE {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
