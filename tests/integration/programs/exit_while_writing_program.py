"""A training loop that exits while a dynprof trace of it is still being written.

Prints ``READY <pid>`` after the first optimizer step. Once a trace is running, it trains a few
more steps, prints ``EXITING`` and returns: the agent's exit hook flushes the trace (partial)
and waits for its write. With ``--exit-on exporting`` it returns as soon as a trace that ended
by itself is being written instead. The write is made slow on purpose, as a large trace's is: the
trace's export first waits until ``--release-file`` exists (at most ``--hold`` seconds). With
``--hold-in torch-write`` it waits inside torch's own write instead, once torch has written the
uncompressed trace file (where torch puts it: its temporary file in ``$TMPDIR`` for a ``.gz``
name), as a write that the job's exit cuts off in the middle is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _trace_loop import after_step, trace_state

import collectors.torch_trace


def slow_export(release: Path, hold_s: float) -> None:
    original = collectors.torch_trace.TraceSession.export

    def export(self: Any, path: Path) -> dict[str, Any]:
        deadline = time.monotonic() + hold_s
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return original(self, path)

    collectors.torch_trace.TraceSession.export = export  # type: ignore[method-assign]


def slow_torch_write(release: Path, hold_s: float) -> None:
    original = torch.autograd.profiler.profile.export_chrome_trace

    def export_chrome_trace(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, path, *args, **kwargs)
        deadline = time.monotonic() + hold_s
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return result

    torch.autograd.profiler.profile.export_chrome_trace = export_chrome_trace  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--release-file", type=Path, required=True)
    parser.add_argument("--hold", type=float, default=300.0)
    parser.add_argument("--steps-after-trace", type=int, default=3)
    parser.add_argument("--exit-on", choices=("tracing", "exporting"), default="tracing")
    parser.add_argument("--optimizer-only", action="store_true", help="steps of the optimizer alone: short spans")
    parser.add_argument("--hold-in", choices=("export", "torch-write"), default="export")
    args = parser.parse_args()
    if args.hold_in == "export":
        slow_export(args.release_file, args.hold)
    else:
        slow_torch_write(args.release_file, args.hold)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    deadline = time.monotonic() + 120
    step = traced = 0
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # gradients for --optimizer-only, which keeps them
    while time.monotonic() < deadline and traced < args.steps_after_trace:
        if not args.optimizer_only:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        step += 1
        after_step(step)
        state = trace_state()
        if state == "tracing":
            traced += 1
        if args.exit_on == "exporting" and state == "exporting":
            break
        if not args.optimizer_only or state != "tracing":
            time.sleep(0.005)
    print(f"EXITING {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
