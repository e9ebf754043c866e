"""A training loop whose optimizer step is compiled (``torch.compile`` of a function that calls
``opt.step()``, Dynamo's eager backend: no C++ compiler needed). Prints ``READY <pid>`` once
the compiled step has run a few times; trains for at most 120 s."""

from __future__ import annotations

import os
import sys
import time

import torch


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))

    @torch.compile(backend="eager")
    def opt_step() -> None:
        opt.step()

    x, y = torch.randn(16, 32), torch.randn(16, 1)
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt_step()
        step += 1
        if step == 3:
            os.write(1, f"READY {os.getpid()}\n".encode())
        time.sleep(0.01)
    return 0


if __name__ == "__main__":
    sys.exit(main())
