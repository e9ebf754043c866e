"""A training loop shaped like timm's train.py with a compiled optimizer step: a small ResNet
(convolutions, BatchNorm, 40 parameter tensors), timm's two parameter groups (no weight decay
for biases and norms), AdamW with a float learning rate that a warm-up + cosine schedule writes
into every parameter group after each update (timm's ``step_update``), a ``torch.compile``d
model and a compiled optimizer step, either ``@torch.compile def step(): opt.step()`` (torch's
"compiling the optimizer" tutorial) or ``torch.compile(opt.step)``. Dynamo's eager backend:
no C++ compiler needed, the same frames and graph breaks as inductor's.

Prints ``READY <pid>`` after 30 steps (compiled and recompiled by then); trains for at most
``--max-seconds``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch import nn


def block(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(width, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
    )


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = torch.relu(x + b(x))
        return self.head(x.mean((2, 3)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """timm's param_groups_weight_decay: no weight decay for biases and 1-d (norm) parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--step-style", choices=("decorator", "method"), default="decorator")
    p.add_argument("--eager-model", action="store_true", help="do not compile the model")
    p.add_argument("--backend", default="eager")
    p.add_argument("--max-seconds", type=float, default=240.0)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    forward = model if args.eager_model else torch.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3)
    if args.step_style == "decorator":

        @torch.compile(backend=args.backend)
        def step() -> None:
            opt.step()

    else:
        step = torch.compile(opt.step, backend=args.backend)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    deadline = time.monotonic() + args.max_seconds
    updates = 0
    while time.monotonic() < deadline:
        loss = nn.functional.cross_entropy(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        step()
        updates += 1
        lr = 1e-3 * min(1.0, updates / 20) * 0.5 * (1 + math.cos(math.pi * min(updates, 10_000) / 10_000))
        for group in opt.param_groups:
            group["lr"] = lr
        if updates == 30:
            os.write(1, f"READY {os.getpid()}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
