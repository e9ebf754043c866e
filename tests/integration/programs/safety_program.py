"""Training loops that put dynprof's profiler control where torch cannot support it.

    --mode checkpoint         activation checkpointing: backward runs Python (the recomputation),
                              so a start or stop requested at any moment often lands in backward
                              (with --backward-sleep S, each block's backward also sleeps S seconds
                              in Python: most of every step is then backward, on any machine)
    --mode opt-in-backward    PyTorch's "optimizer step in backward" recipe: one optimizer per
                              parameter, stepped from post-accumulate-grad hooks (step boundaries
                              are inside backward)
    --mode own-profiler       the job runs its own torch.profiler with a schedule and on_trace_ready
    --mode recreate           a new optimizer every --recreate-every steps (stages, k-fold)
    --mode compiled-step      the optimizer step runs under torch.compile (Dynamo traces the
                              global step hooks; backend "eager" keeps it quick on a CPU)
    --mode plain              a plain loop

Prints ``READY <pid>`` after the first step, ``LOSS <step> <value>`` every step (exact repr, to
compare runs with and without dynprof), ``JOBTRACE <n>`` when its own profiler wrote a trace,
and ``DONE <steps>`` at the end. With ``--park-at N --park-file PATH`` it stops after step N,
says ``PARKED N`` and waits (inside ``dynprof.phase("parked")``: no hang) until PATH exists.
With ``--stop-file PATH`` it ends at the first step boundary after PATH exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps in Python: a backward that takes long on any machine."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


def park(path: str, step: int) -> None:
    """Stop stepping until ``path`` exists (at most 120 s), in a marked phase."""
    import dynprof

    os.write(1, f"PARKED {step}\n".encode())
    with dynprof.phase("parked"):
        until = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < until:
            time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        choices=["checkpoint", "opt-in-backward", "own-profiler", "recreate", "compiled-step", "plain"],
        required=True,
    )
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--recreate-every", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--backward-sleep", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--park-at", type=int, default=0)
    parser.add_argument("--park-file", default="")
    parser.add_argument("--stop-file", default="")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(*[Block(args.width) for _ in range(args.depth)], torch.nn.Linear(args.width, 1)).to(
        device
    )
    x = torch.randn(64, args.width, device=device)
    y = torch.randn(64, 1, device=device)

    def make_optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    opt: torch.optim.Optimizer | None = None
    if args.mode == "opt-in-backward":
        per_param = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

        def step_in_backward(p: torch.Tensor) -> None:
            per_param[p].step()
            per_param[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
    else:
        opt = make_optimizer()

    prof = None
    traces_written = 0
    if args.mode == "own-profiler":
        out_dir = tempfile.mkdtemp(prefix="jobtrace-")

        def ready(p: torch.profiler.profile) -> None:
            nonlocal traces_written
            traces_written += 1
            p.export_chrome_trace(os.path.join(out_dir, f"job-{traces_written}.json"))
            print(f"JOBTRACE {traces_written}", flush=True)

        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=3, warmup=1, active=2, repeat=0),
            on_trace_ready=ready,
        )
        prof.start()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        h = inp
        for layer in model[:-1]:
            h = checkpoint(layer, h, use_reentrant=False) if args.mode == "checkpoint" else layer(h)
            if args.backward_sleep:
                h = SlowBackward.apply(h, args.backward_sleep)
        return model[-1](h)

    optimizer_step = opt.step if opt is not None else None
    if args.mode == "compiled-step" and opt is not None:
        optimizer_step = torch.compile(opt.step, backend="eager")

    deadline = time.monotonic() + args.max_seconds
    step = 0
    while time.monotonic() < deadline and (not args.max_steps or step < args.max_steps):
        if args.stop_file and os.path.exists(args.stop_file):
            break
        if args.mode == "recreate" and step and step % args.recreate_every == 0:
            opt = make_optimizer()  # a new stage: a fresh optimizer starts at its own step 1
        loss = torch.nn.functional.mse_loss(forward(x), y)
        if opt is not None:
            opt.zero_grad()
        loss.backward()
        if opt is not None:
            (optimizer_step if args.mode == "compiled-step" else opt.step)()
        if prof is not None:
            prof.step()
        step += 1
        os.write(1, f"LOSS {step} {loss.item()!r}\n".encode())
        if step == 1:
            os.write(1, f"READY {os.getpid()}\n".encode())
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.park_at and step == args.park_at:
            park(args.park_file, step)
    if prof is not None:
        prof.stop()
    print(f"DONE {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
