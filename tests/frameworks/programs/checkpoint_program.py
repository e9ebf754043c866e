"""A plain ``torch.utils.checkpoint`` training loop: every block's forward runs again inside
``loss.backward()``, so Python code (and CPython's pending calls) runs inside backward."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, mse_step, parser, seed_everything
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width * 2)
        self.fc2 = torch.nn.Linear(width * 2, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self, width: int, depth: int, reentrant: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--reentrant", action="store_true", help="use_reentrant=True checkpointing")
    args = p.parse_args()
    seed_everything(0, args.threads)
    device = torch.device(args.device)
    model = Net(args.width, args.depth, args.reentrant).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, args.width).to(device).requires_grad_(args.reentrant)
    y = torch.randn(64, 1).to(device)
    return Pacer(args).run(mse_step(model, opt, x, y))


if __name__ == "__main__":
    sys.exit(main())
