"""A small training loop whose model has repeated blocks, for `dynprof memory plan`'s tests.

Prints ``READY <pid>`` after its first optimizer step and trains until --max-seconds. Each
block is Linear(W, 4W) -> GELU -> Linear(4W, W) with a residual; the blocks sit in a ModuleList
between an input Linear and a head.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--step-sleep", type=float, default=0.01)
    parser.add_argument(
        "--probe-file",
        default="",
        help="once this file exists, print the hooks left on the model and autograd's saved-tensor hooks",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Model(args.width, args.depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)
    deadline = time.monotonic() + args.max_seconds
    ready = False
    while time.monotonic() < deadline:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())
            ready = True
        if args.probe_file and os.path.exists(args.probe_file):
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
            saved = torch._C._autograd._top_saved_tensors_default_hooks(False)
            os.write(
                1, f"HOOKS forward={hooks} saved_tensors={saved is not None} grad={torch.is_grad_enabled()}\n".encode()
            )
            args.probe_file = ""
        time.sleep(args.step_sleep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
