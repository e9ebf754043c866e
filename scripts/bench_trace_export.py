#!/usr/bin/env python3
"""Measure how long a trace's export takes per recorded event (CPU), which bounds how long
the job's exit is held for a trace being written (DYNPROF_TRACE_EXIT_WAIT_S, default 60 s).

A small MLP is trained in this process under dynprof's own profiler session
(``collectors.torch_trace.TraceSession``) for a growing number of steps; each trace is then
exported the way the agent does (gzipped Chrome trace JSON), timed, and its events counted.
Printed per size: events, export seconds, microseconds per event, and the number of events
that fit in the exit's wait at that rate.

    python scripts/bench_trace_export.py [--steps 50,200,800] [--width 128] [--with-stack]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="50,200,800", help="comma-separated trace lengths in steps")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--with-stack", action="store_true", help="record Python stacks, as --with-stack does")
    args = parser.parse_args()

    import torch

    from collectors.torch_trace import TraceOptions, TraceSession, read_trace
    from dynprof.agent._trace_write import DEFAULT_EXIT_WAIT_S, exit_wait_s

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, args.width), torch.randn(32, 1)
    wait_s = exit_wait_s()
    print(f"torch {torch.__version__}; exit wait {wait_s:g} s (default {DEFAULT_EXIT_WAIT_S:g} s)")
    print(f"{'steps':>7} {'events':>9} {'export s':>9} {'us/event':>9} {'events in wait':>15}")
    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (int(s) for s in args.steps.split(",")):
            session = TraceSession(TraceOptions(with_stack=args.with_stack), {"rank": 0, "world_size": 1})
            session.start(first_step=1)
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                session.step()
            session.stop()
            path = Path(tmp) / f"trace-{steps}.json.gz"
            t0 = time.perf_counter()
            session.export(path)
            export_s = time.perf_counter() - t0
            events = len(read_trace(path).get("traceEvents", []))
            per_event_us = export_s / max(1, events) * 1e6
            rates.append(per_event_us)
            print(f"{steps:>7} {events:>9} {export_s:>9.3f} {per_event_us:>9.2f} {wait_s / per_event_us * 1e6:>15,.0f}")
    worst = max(rates)
    print(f"slowest rate {worst:.2f} us/event: the exit's {wait_s:g} s wait covers {wait_s / worst * 1e6:,.0f} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
