#!/usr/bin/env python3
"""Attach N times in a row and count failures (target: 0 in >= 200).

Two series, each against targets that run a step loop and an allocation-heavy second thread:
* fresh: N new processes, one attach each (the agent starts in each);
* repeat: one process, N injections in a row (the full gdb pending-call path each time; the
  bootstrap then finds the agent and reports "already").
After each attach the agent must answer a status request and the target must still run.
Light targets (pure-Python loop) by default; --torch uses the torch training loop.

    python scripts/stress_attach.py [--n 200] [--series fresh,repeat] [--torch]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _attach_targets import Target  # noqa: E402

from dynprof import errors  # noqa: E402
from dynprof.attach import AttachOptions, attach  # noqa: E402
from dynprof.client import AgentClient  # noqa: E402


def one(target: Target, options: AttachOptions) -> tuple[bool, float, str]:
    t0 = time.monotonic()
    try:
        result = attach(target.pid, options)
        AgentClient.for_pid(target.pid, timeout=5.0).status()
    except errors.DynprofError as exc:
        return False, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - t0
    time.sleep(0.05)
    if not target.alive():
        return False, elapsed, f"target died (exit {target.proc.returncode}): {target.lines[-3:]}"
    return True, elapsed, result.status


def report(name: str, n: int, failures: list[str], latencies: list[float]) -> None:
    lat = sorted(latencies)
    print(
        f"{name}: N={n} failures={len(failures)} latency median {statistics.median(lat):.3f} s, max {lat[-1]:.3f} s",
        flush=True,
    )
    for f in failures[:10]:
        print(f"  {f}")


def progress(name: str, i: int, n: int, failures: list[str]) -> None:
    if (i + 1) % 25 == 0 or i + 1 == n:
        print(f"  {name}: {i + 1}/{n} done, {len(failures)} failure(s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--series", default="fresh,repeat")
    parser.add_argument("--torch", action="store_true", help="torch training-loop targets (slower to start)")
    args = parser.parse_args()
    os.environ.setdefault("DYNPROF_RUN_DIR", tempfile.mkdtemp(prefix="dp-stress-", dir="/tmp"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: no orphaned targets
    total_fail = 0
    if "fresh" in args.series:
        failures, lat = [], []
        for i in range(args.n):
            target = Target(torch=args.torch)
            try:
                target.wait_ready()
                ok, elapsed, what = one(target, AttachOptions())
                lat.append(elapsed)
                if not ok or what != "attached":
                    failures.append(f"#{i} pid {target.pid}: {what}")
                progress("fresh", i, args.n, failures)
            finally:
                target.stop()
        report("fresh targets", args.n, failures, lat)
        total_fail += len(failures)
    if "repeat" in args.series:
        failures, lat = [], []
        target = Target(torch=args.torch)
        try:
            target.wait_ready()
            for i in range(args.n):
                ok, elapsed, what = one(target, AttachOptions(check_existing=i == 0))
                lat.append(elapsed)
                if not ok:
                    failures.append(f"#{i}: {what}")
                    if not target.alive():
                        break
                progress("repeat", i, args.n, failures)
            alive = target.alive()
        finally:
            target.stop()
        report(f"repeated injection into pid {target.pid} (alive at the end: {alive})", args.n, failures, lat)
        total_fail += len(failures) + (0 if alive else 1)
    return 1 if total_fail else 0


if __name__ == "__main__":
    sys.exit(main())
