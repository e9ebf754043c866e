"""A small real training loop for dynprof's integration tests and demo.

Prints ``READY <pid>`` once the first optimizer step has completed (or, with
--no-optimizer, once the loop is running), then keeps training until --max-steps,
--max-seconds or --stop-file. With --rank-env it reads RANK/WORLD_SIZE and joins a gloo process group.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--stop-file", default="", help="end normally once this file exists")
    parser.add_argument("--no-optimizer", action="store_true", help="forward passes only, no optimizer")
    parser.add_argument("--dist", action="store_true", help="join a gloo process group from RANK/WORLD_SIZE")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--agent-api", action="store_true", help="start the agent with dynprof.agent.start()")
    parser.add_argument(
        "--stop-stepping-after",
        type=int,
        default=0,
        help="after this many steps, stop stepping and sleep (a stuck loop)",
    )
    parser.add_argument(
        "--hold-gil-seconds",
        type=int,
        default=0,
        help="when stuck, first spend this long in a C call that holds the GIL",
    )
    args = parser.parse_args()

    if args.agent_api:
        import dynprof.agent

        dynprof.agent.start()
    if args.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    ).to(device)
    opt = None if args.no_optimizer else torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, args.width, device=device)
    y = torch.randn(32, 1, device=device)
    deadline = time.monotonic() + args.max_seconds
    step = 0
    ready = False
    while time.monotonic() < deadline and (not args.max_steps or step < args.max_steps):
        if args.stop_stepping_after and step >= args.stop_stepping_after:
            if args.hold_gil_seconds:
                stuck_holding_gil(args.hold_gil_seconds)
            stuck_forever(deadline)
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        if opt is not None:
            opt.zero_grad()
            loss.backward()
            if args.dist:
                import torch.distributed as dist

                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
        step += 1
        if not ready:
            os.write(1, f"READY {os.getpid()}\n".encode())  # one write: ranks may share the pipe
            ready = True
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.stop_file and os.path.exists(args.stop_file):
            break
    print(f"DONE {step}", flush=True)
    return 0


def stuck_holding_gil(seconds: int) -> None:
    import ctypes

    ctypes.PyDLL("libc.so.6").sleep(seconds)  # a PyDLL call keeps the GIL: no Python runs meanwhile


def stuck_forever(deadline: float) -> None:
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
