"""``torch.compile`` of the model and of the optimizer step (PyTorch's "compiling the
optimizer" recipe), with a tensor learning rate so the scheduler does not recompile."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()
    seed_everything(0, args.threads)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width * 2), torch.nn.GELU(), torch.nn.Linear(args.width * 2, 1)
    )
    compiled = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=args.max_steps)

    @torch.compile(fullgraph=False)
    def opt_step() -> None:
        opt.step()

    x = torch.randn(64, args.width)
    y = torch.randn(64, 1)
    pacer = Pacer(args)

    def step() -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt_step()
        sched.step()
        return loss

    return pacer.run(step)


if __name__ == "__main__":
    sys.exit(main())
