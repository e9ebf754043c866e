#!/usr/bin/env python3
"""Attach latency and the pause the target sees (targets: <= 1.5 s to agent ready, <= 150 ms).

Starts a torch training loop with plain python (tests/integration/programs/attach_program.py,
~6 ms steps; --churn adds an allocation-heavy second thread, whose GIL contention makes the
loop's own gaps reach a second on a loaded 2-core machine, hiding attach's), attaches to it with
`dynprof.attach.attach` and measures:
* latency: from the call to the agent ready (its socket answering);
* pause: the longest gap between two consecutive steps of the target's loop while attach was
  under way, next to the longest gap in a quiet window of the same length before it (the
  machine's own noise).
One fresh process per round (the agent starts once per process).

    python scripts/bench_attach.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _attach_targets import Target  # noqa: E402

from dynprof.attach import attach  # noqa: E402
from dynprof.client import AgentClient  # noqa: E402

GAP_MS = 15.0  # the target reports every step gap longer than this


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn", action="store_true", help="run an allocation-heavy second thread in the target")
    args = parser.parse_args()
    os.environ.setdefault("DYNPROF_RUN_DIR", tempfile.mkdtemp(prefix="dp-bench-", dir="/tmp"))
    latencies, injects, pauses, quiet = [], [], [], []
    for i in range(args.rounds):
        target = Target(torch=True, gap_ms=GAP_MS, churn=args.churn)
        try:
            target.wait_ready()
            time.sleep(3.0)  # past start-up
            t0 = time.time()
            result = attach(target.pid)
            AgentClient.for_pid(target.pid).status()
            t1 = time.time()
            time.sleep(0.5)
            window = t1 - t0
            # The quiet window: the same length, ending 0.5 s before attach began.
            before = target.gaps(t0 - 0.5 - window, t0 - 0.5)
            during = target.gaps(t0, t1 + 0.2)
            latencies.append(t1 - t0)
            injects.append(result.inject_s)
            pauses.append(max(during, default=0.0))
            quiet.append(max(before, default=0.0))
            print(
                f"round {i + 1}: {result.method}, ready after {t1 - t0:.3f} s (gdb ran {result.inject_s:.3f} s); "
                f"longest step gap during attach {pauses[-1]:.0f} ms, in a quiet window before {quiet[-1]:.0f} ms "
                f"(gaps > {GAP_MS:g} ms reported; a normal step is ~6 ms)",
                flush=True,
            )
        finally:
            target.stop()
    print(
        f"\nattach -> agent ready: median {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s "
        f"(target <= 1.5 s); gdb attached: median {statistics.median(injects):.3f} s"
    )
    print(
        f"longest pause seen by the target: median {statistics.median(pauses):.0f} ms, max {max(pauses):.0f} ms "
        f"(target <= 150 ms); same-length quiet windows: max {max(quiet):.0f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
