#!/usr/bin/env python3
"""Wall time of `dynprof stacks` over N local training processes (default 8).

Starts N copies of tests/integration/programs/train_program.py under `dynprof run` (one job),
waits until each has stepped, then times the whole CLI command (process start included), as an
on-call engineer would run it: Python frames, then --native. Prints each run and the median.
The baseline, in the same session: one plain `py-spy dump` of one process, run serially N times.

    python scripts/bench_stacks.py [--procs 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "integration" / "programs" / "train_program.py"


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dp-bench-", dir="/tmp"))
    env = dict(
        os.environ,
        DYNPROF_RUN_DIR=str(tmp / "run"),
        DYNPROF_ARTIFACT_DIR=str(tmp / "art"),
        DYNPROF_JOB_ID="bench",
        PYTHONUNBUFFERED="1",
    )
    procs = []
    try:
        for _ in range(args.procs):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dynprof",
                        "run",
                        "-q",
                        "--",
                        sys.executable,
                        str(PROGRAM),
                        "--step-sleep",
                        "0.01",
                        "--max-seconds",
                        "600",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=env,
                    cwd=str(ROOT),
                )
            )
        pids = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("READY"):
                raise SystemExit(f"a target did not start: {line!r}")
            pids.append(int(line.split()[1]))
        cli = [sys.executable, "-m", "dynprof", "stacks", "--job", "bench", "--no-save"]
        print(f"{args.procs} training processes (torch imported, stepping); python {sys.version.split()[0]}")
        results = {}
        for label, extra in (("python frames", []), ("--native", ["--native"])):
            times = [timed(cli + extra, env) for _ in range(args.repeat)]
            results[label] = statistics.median(times)
            print(
                f"dynprof stacks --job ({label}): median {results[label]:.3f} s  "
                f"runs: {', '.join(f'{t:.3f}' for t in times)}"
            )
        spy = shutil.which("py-spy")
        if spy:
            serial = [timed([spy, "dump", "--pid", str(pid)], env) for pid in pids]
            print(
                f"baseline: py-spy dump, one process after another: {sum(serial):.3f} s for {len(pids)} "
                f"({statistics.median(serial) * 1000:.0f} ms each)"
            )
            print(f"ratio dynprof stacks / serial py-spy: {results['python frames'] / sum(serial):.2f}")
        target = 1.0
        verdict = "meets" if results["python frames"] < target else "MISSES"
        print(f"target < {target:.0f} s for Python frames: {verdict}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
