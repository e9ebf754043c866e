"""A job that profiles itself with the documented ``torch.profiler.profile(schedule=...,
on_trace_ready=...)`` pattern, the whole run long, and reports each trace it receives."""

from __future__ import annotations

import sys

import torch
from _job import Pacer, emit, mse_step, parser, seed_everything


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    seed_everything(0, args.threads)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    ).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, args.width).to(args.device)
    y = torch.randn(64, 1).to(args.device)
    received = 0

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        nonlocal received
        received += 1
        steps = sum(1 for e in prof.events() if e.name.startswith("ProfilerStep"))
        emit(f"OWN_TRACE {received} steps {steps}")

    pacer = Pacer(args)
    schedule = torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready) as prof:
        train_step = mse_step(model, opt, x, y)

        def step() -> torch.Tensor:
            loss = train_step()
            prof.step()
            return loss

        pacer.train(step)
    pacer.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
