"""Two-stage training, as in fine-tuning or k-fold loops: a fresh optimizer (and scheduler)
for stage 2. Prints ``STAGE 2`` when the new optimizer is created."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, emit, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--stage-steps", type=int, default=150, help="optimizer steps of stage 1")
    args = p.parse_args()
    seed_everything(0, args.threads)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    x = torch.randn(64, args.width)
    y = torch.randn(64, 1)
    pacer = Pacer(args)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    stage = 1

    def step() -> torch.Tensor:
        nonlocal opt, sched, stage
        if stage == 1 and pacer.steps == args.stage_steps:
            stage = 2
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
            emit("STAGE 2")
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return pacer.run(step)


if __name__ == "__main__":
    sys.exit(main())
