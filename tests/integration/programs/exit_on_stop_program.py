"""A training loop that ends as soon as a dynprof trace of it starts exporting.

Prints ``READY <pid>`` after the first optimizer step. Once the agent's trace has been
stopped (its state turns to ``exporting``), the loop ends and the process exits normally
while the export may still be running: the agent finishes it at exit.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import dynprof.agent


def trace_state() -> str:
    agent = dynprof.agent.get()
    controller = agent.extensions.get("dynprof.agent._ext_trace") if agent is not None else None
    return str(getattr(controller, "state", "idle"))


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step == 1:
            os.write(1, f"READY {os.getpid()}\n".encode())
        if trace_state() == "exporting":
            break
        time.sleep(0.005)
    print(f"DONE {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
