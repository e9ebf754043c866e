"""A CUDA job that trains a few steps, then stops stepping and captures CUDA graphs, one after
another, in PyTorch's default capture mode (global: any thread's unsafe CUDA call during a capture
fails it), for ``--seconds``: what a job does while compiling for ``mode="reduce-overhead"`` or
warming an evaluation's graphs, with no optimizer step meanwhile. Its agent's status answers then
query the step marker and run the progress probe from the agent's thread during the captures.

Prints ``READY <pid>`` when the captures begin and ``DONE captures=N`` when every one succeeded
(a failed capture raises, and the job exits 1)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device=device)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(device)
    static_x = torch.randn(64, 512, device=device)
    print(f"READY {os.getpid()}", flush=True)
    captures = 0
    until = time.monotonic() + args.seconds
    with torch.no_grad():
        while time.monotonic() < until:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(static_x)  # warm-up on a side stream, as torch's docs do
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # capture_error_mode="global", the default
                y = model(static_x)
                for _ in range(200):
                    y = torch.relu(y) * 0.5
            graph.replay()
            torch.cuda.synchronize(device)
            captures += 1
    print(f"DONE captures={captures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
