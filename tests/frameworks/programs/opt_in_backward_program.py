"""PyTorch's "optimizer step in backward" recipe: one optimizer per parameter, stepped from
``register_post_accumulate_grad_hook`` while ``loss.backward()`` runs; the loop itself never
calls ``optimizer.step()``."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, mlp, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    seed_everything(0, args.threads)
    model = mlp(args.width)
    optimizers = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    x = torch.randn(64, args.width)
    y = torch.randn(64, 1)
    pacer = Pacer(args)

    def step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # every optimizer steps in here
        return loss

    return pacer.run(step)


if __name__ == "__main__":
    sys.exit(main())
